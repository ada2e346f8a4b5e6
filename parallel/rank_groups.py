"""Rank groups of a TP x CP x DP layout, as a pure function (no processes needed).

Rank order is Megatron's ``tp-cp-dp`` (TP fastest):
``rank = tp_rank + tp * (cp_rank + cp * dp_rank)``, i.e. ``arange(world).reshape(dp, cp, tp)``.
A later ``pp`` axis goes after ``dp`` in ``AXIS_ORDER``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

Groups = tuple[tuple[int, ...], ...]
AXIS_ORDER = ("tp", "cp", "dp")  # fastest-varying first


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


def check_sizes(tp: int, cp: int, dp: int) -> None:
    for name, size in (("tp", tp), ("cp", cp), ("dp", dp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")


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


def compute_rank_groups(world_size: int, tp: int, cp: int, dp: int, ulysses: int = 1) -> RankGroups:
    """All TP, CP, DP, DP x CP and TP x CP groups of the layout, and the CP groups' Ulysses (adjacent CP
    ranks, ``ulysses`` of them) and ring (same place in their Ulysses group) subgroups (pure; ValueError)."""
    check_world(world_size, tp, cp, dp)
    check_ulysses(cp, ulysses)
    sizes = dict(zip(AXIS_ORDER, (tp, cp, dp), strict=True))
    split = {"tp": tp, "ulysses": ulysses, "ring": cp // ulysses, "dp": dp}  # cp rank = ring * ulysses + place
    return RankGroups(tp=_groups_along(sizes, ("tp",)), cp=_groups_along(sizes, ("cp",)),
                      dp=_groups_along(sizes, ("dp",)), dp_cp=_groups_along(sizes, ("cp", "dp")),
                      tp_cp=_groups_along(sizes, ("tp", "cp")), cp_ulysses=_groups_along(split, ("ulysses",)),
                      cp_ring=_groups_along(split, ("ring",)))


def rank_coordinates(rank: int, tp: int, cp: int, dp: int) -> tuple[int, int, int]:
    """``(tp_rank, cp_rank, dp_rank)`` of global ``rank`` (pure; raises ValueError)."""
    check_sizes(tp, cp, dp)
    if not 0 <= rank < tp * cp * dp:
        raise ValueError(f"rank {rank} is outside the world of size tp*cp*dp = {tp * cp * dp}")
    return rank % tp, (rank // tp) % cp, rank // (tp * cp)


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
