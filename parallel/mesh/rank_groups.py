"""Rank groups of a TP x CP x DP layout, as a pure function (no processes needed).

Rank order is Megatron's ``tp-cp-dp`` (TP fastest):
``rank = tp_rank + tp * (cp_rank + cp * dp_rank)``, i.e. ``arange(world).reshape(dp, cp, tp)``. Under HSDP
(``dp_replicate`` > 1) the DP rank splits as ``dp_rank = shard_rank + (dp / dp_replicate) * replica``: FSDP shards
over a replica's ``dp_shard_cp`` ranks (consecutive: one node when they fit) and replicates across replicas.
``ParallelDims`` holds the sizes keyed by axis name; a later axis (``pp``, ``ep``) is one more entry of
``AXIS_ORDER`` (and of ``DATA_AXES`` when it splits the batch), not a rewrite of positional triples.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import product

Groups = tuple[tuple[int, ...], ...]
AXIS_ORDER = ("tp", "cp", "dp")  # fastest-varying first
DATA_AXES = ("dp", "cp")  # the axes that split the global batch: gradients are summed (and FSDP shards) over them
DATA_AXIS = "dp_cp"  # the name of their flattened mesh dimension


class ParallelDims(Mapping[str, int]):
    """Sizes of the parallel axes keyed by name, e.g. ``ParallelDims(tp=2, cp=4)`` (an axis left out has size 1).

    Iterates in ``AXIS_ORDER`` (fastest-varying first); ``mesh_names`` / ``mesh_shape`` give the DeviceMesh
    order (slowest first). Equal to any mapping with the same sizes; ``str`` is ``tp=2, cp=4, dp=1``.
    """

    def __init__(self, **sizes: int) -> None:
        unknown = sorted(set(sizes) - set(AXIS_ORDER))
        if unknown:
            raise ValueError(f"unknown parallel axis {', '.join(unknown)}; the axes are {', '.join(AXIS_ORDER)}")
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        self._sizes = {name: sizes.get(name, 1) for name in AXIS_ORDER}

    @classmethod
    def from_layout(cls, layout: Mapping[str, object]) -> ParallelDims:
        """The axes of a mapping that may hold other keys too (a checkpoint's ``layout``: world_size, ...)."""
        return cls(**{name: int(layout[name]) for name in AXIS_ORDER if name in layout})  # type: ignore[arg-type]

    def __getitem__(self, axis: str) -> int:
        return self._sizes[axis]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __hash__(self) -> int:
        return hash(tuple(self._sizes.items()))

    def __repr__(self) -> str:
        return f"ParallelDims({self})"

    def __str__(self) -> str:
        return ", ".join(f"{name}={size}" for name, size in self._sizes.items())

    @property
    def tp(self) -> int:
        return self._sizes["tp"]

    @property
    def cp(self) -> int:
        return self._sizes["cp"]

    @property
    def dp(self) -> int:
        return self._sizes["dp"]

    @property
    def world(self) -> int:
        return math.prod(self._sizes.values())

    @property
    def data(self) -> int:
        """The size of the flattened data axes (``DATA_AXIS``: gradient sum, FSDP sharding)."""
        return math.prod(self._sizes[name] for name in DATA_AXES)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return tuple(reversed(AXIS_ORDER))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self._sizes[name] for name in self.mesh_names)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This global ``rank``'s index along every axis (ValueError outside the world)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of size {'*'.join(AXIS_ORDER)} = {self.world}")
        out = {}
        for name, size in self._sizes.items():
            rank, out[name] = divmod(rank, size)
        return out


@dataclass(frozen=True)
class RankGroups:
    """Every group of each kind as sorted tuples of global ranks, ordered by first member."""

    tp: Groups
    cp: Groups
    dp: Groups
    dp_cp: Groups  # gradient reduction
    tp_cp: Groups
    cp_ulysses: Groups = ()  # adjacent CP ranks (hybrid CP: all-to-all inside, the ring across)
    cp_ring: Groups = ()  # CP ranks with the same place in their Ulysses group
    dp_shard_cp: Groups = ()  # HSDP: the ranks FSDP shards over (one replica's DP x CP)
    dp_replicate: Groups = ()  # HSDP: the same shard in every replica (gradients all-reduced across)


def check_sizes(tp: int, cp: int, dp: int) -> None:
    ParallelDims(tp=tp, cp=cp, dp=dp)


def check_world(world_size: int, tp: int, cp: int, dp: int) -> None:
    check_sizes(tp, cp, dp)
    if world_size != tp * cp * dp:
        raise ValueError(f"world size {world_size} != tp*cp*dp = {tp}*{cp}*{dp} = {tp * cp * dp}; "
                         f"choose sizes whose product is {world_size}")


def _groups_along(sizes: dict[str, int], along: tuple[str, ...]) -> Groups:
    """Groups varying the ``along`` axes with the other axes fixed (``sizes`` fastest first)."""
    strides, stride = {}, 1
    for name, size in sizes.items():
        strides[name], stride = stride, stride * size
    fixed = [name for name in reversed(list(sizes)) if name not in along]  # slowest first
    groups = []
    for outer in product(*(range(sizes[name]) for name in fixed)):
        base = sum(c * strides[name] for name, c in zip(fixed, outer, strict=True))
        members = (base + sum(c * strides[name] for name, c in zip(along, inner, strict=True))
                   for inner in product(*(range(sizes[name]) for name in along)))
        groups.append(tuple(sorted(members)))
    return tuple(groups)


def check_ulysses(cp: int, ulysses: int) -> None:
    """ValueError naming the keys unless ``ulysses`` (the Ulysses degree inside CP) divides ``cp``."""
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1:
        raise ValueError(f"parallel.ulysses_size must be an integer >= 1, got {ulysses!r}")
    if cp % ulysses:
        raise ValueError(f"parallel.ulysses_size {ulysses} does not divide parallel.cp {cp}: cp = ulysses_size x "
                         f"ring size; choose a ulysses_size among the divisors of {cp}")


def check_replicate(dp: int, dp_replicate: int) -> None:
    """ValueError naming the keys unless ``dp_replicate`` (HSDP's replicas) divides ``dp``."""
    if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1:
        raise ValueError(f"parallel.dp_replicate must be an integer >= 1, got {dp_replicate!r}")
    if dp % dp_replicate:
        raise ValueError(f"parallel.dp_replicate {dp_replicate} does not divide the DP size {dp}: dp = dp_replicate x "
                         f"the DP ranks of a replica; choose a dp_replicate among the divisors of {dp}")


@functools.lru_cache(maxsize=None, typed=True)  # typed: dp=2.0 is refused, not a hit of dp=2
def compute_rank_groups(world_size: int, tp: int, cp: int, dp: int, ulysses: int = 1,
                        dp_replicate: int = 1) -> RankGroups:
    """All TP, CP, DP, DP x CP and TP x CP groups of the layout, the CP groups' Ulysses (adjacent CP ranks,
    ``ulysses`` of them) and ring (same place in their Ulysses group) subgroups, and HSDP's shard (a replica's
    DP x CP) and replicate groups (pure; ValueError)."""
    check_world(world_size, tp, cp, dp)
    check_ulysses(cp, ulysses)
    check_replicate(dp, dp_replicate)
    sizes = dict(ParallelDims(tp=tp, cp=cp, dp=dp))
    split = {"tp": tp, "ulysses": ulysses, "ring": cp // ulysses, "dp": dp}  # cp rank = ring * ulysses + place
    hsdp = {"tp": tp, "cp": cp, "shard": dp // dp_replicate, "replica": dp_replicate}
    return RankGroups(tp=_groups_along(sizes, ("tp",)), cp=_groups_along(sizes, ("cp",)),
                      dp=_groups_along(sizes, ("dp",)), dp_cp=_groups_along(sizes, ("cp", "dp")),
                      tp_cp=_groups_along(sizes, ("tp", "cp")), cp_ulysses=_groups_along(split, ("ulysses",)),
                      cp_ring=_groups_along(split, ("ring",)), dp_shard_cp=_groups_along(hsdp, ("cp", "shard")),
                      dp_replicate=_groups_along(hsdp, ("replica",)))


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node of global ``rank`` when every node runs ``ranks_per_node`` consecutive ranks (torchrun's order)."""
    return rank // ranks_per_node


def crossing_nodes(groups: RankGroups, ranks_per_node: int) -> tuple[str, ...]:
    """The kinds of group (``tp``, ``cp``, ``dp_cp``, ...) of which some group spans more than one node."""
    kinds = ("tp", "cp", "dp", "dp_cp", "tp_cp", "cp_ulysses", "cp_ring", "dp_shard_cp", "dp_replicate")
    return tuple(kind for kind in kinds if any(len({node_of(r, ranks_per_node) for r in group}) > 1
                                               for group in getattr(groups, kind)))


def rank_coordinates(rank: int, tp: int, cp: int, dp: int) -> tuple[int, int, int]:
    """``(tp_rank, cp_rank, dp_rank)`` of global ``rank`` (pure; raises ValueError)."""
    coordinates = ParallelDims(tp=tp, cp=cp, dp=dp).coordinates(rank)
    return coordinates["tp"], coordinates["cp"], coordinates["dp"]


def resolve_dp(world_size: int, tp: int, cp: int, dp: int | None) -> int:
    """The DP size: ``dp``, or ``world_size // (tp * cp)`` when None.

    ValueError (naming the numbers) when the layout does not fill the world.
    """
    check_sizes(tp, cp, 1 if dp is None else dp)
    if dp is None:
        if world_size % (tp * cp) != 0:
            raise ValueError(f"world size {world_size} is not divisible by tp*cp = {tp}*{cp} = {tp * cp}; "
                             f"choose tp and cp whose product divides {world_size}")
        dp = world_size // (tp * cp)
    check_world(world_size, tp, cp, dp)
    return dp
