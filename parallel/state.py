"""Process groups for TP x CP x DP, built once per process on a named DeviceMesh.

Rank order is Megatron's ``tp-cp-dp`` (see ``parallel/rank_groups.py`` for the pure
rank-group function, re-exported here). ``initialize_parallel`` creates
the groups (every rank creates every group, in the same order) and returns a
``ParallelState``; the Megatron-named getters below read that current state. Library
modules receive groups explicitly and never call the getters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.attention_spec import CPGroups
from parallel.rank_groups import (  # noqa: F401  (re-exported)
    AXIS_ORDER,
    DATA_AXES,
    DATA_AXIS,
    Groups,
    ParallelDims,
    RankGroups,
    check_sizes,
    check_ulysses,
    check_world,
    compute_rank_groups,
    rank_coordinates,
    resolve_dp,
)

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class AxisGroup:
    """One process group seen from this rank: its size, this rank's index, the members' global ranks."""

    size: int
    rank: int
    group: dist.ProcessGroup
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ParallelState:
    """The groups of this process. ``dims`` holds the axis sizes by name; ``mesh`` has dims
    ``("dp", "cp", "tp")`` over ``arange(world).reshape(dp, cp, tp)``; ``dp_cp_mesh`` / ``tp_cp_mesh`` are
    its flattenings of ``("dp", "cp")`` / ``("cp", "tp")``; ``shard_mesh`` is the 2-D ``("dp_cp", "tp")``
    mesh on the same groups (where FSDP-sharded, TP-sharded tensors live for DCP). ``cp_prev_rank`` /
    ``cp_next_rank`` are the global ranks of this rank's CP ring neighbours (itself when cp == 1)."""

    dims: ParallelDims
    world_size: int
    rank: int
    backend: str
    tp: AxisGroup
    cp: AxisGroup
    dp: AxisGroup
    dp_cp: AxisGroup
    tp_cp: AxisGroup
    cp_prev_rank: int
    cp_next_rank: int
    mesh: DeviceMesh
    dp_cp_mesh: DeviceMesh
    tp_cp_mesh: DeviceMesh
    shard_mesh: DeviceMesh
    owns_default_group: bool
    cp_ulysses: AxisGroup | None = None  # hybrid CP: adjacent CP ranks (all-to-all inside)
    cp_ring: AxisGroup | None = None  # hybrid CP: the same place in each Ulysses group (the ring across)

    @property
    def cp_groups(self) -> CPGroups:
        """The CP group and, for hybrid CP, its Ulysses and ring subgroups (what the attention takes)."""
        return CPGroups(self.cp.group, self.cp_ulysses.group if self.cp_ulysses else None,
                        self.cp_ring.group if self.cp_ring else None)


_STATE: ParallelState | None = None


def _axis(mesh: DeviceMesh) -> AxisGroup:
    group = mesh.get_group()
    return AxisGroup(size=dist.get_world_size(group), rank=dist.get_rank(group), group=group,
                     ranks=tuple(dist.get_process_group_ranks(group)))


def _subgroup_override(backend: str, timeout: timedelta) -> tuple[str, Any] | None:
    """(backend, a NEW options object carrying ``timeout``) for one mesh dimension's groups; None where
    the backend has no options. Call it once per dimension: c10d writes each group's ranks and name
    into its options object, so an object shared by several groups would be overwritten."""
    names = {"gloo": ("ProcessGroupGloo", "_Options"), "nccl": ("ProcessGroupNCCL", "Options")}
    try:
        options = getattr(getattr(dist, names[backend][0]), names[backend][1])()
        options._timeout = timeout
    except (KeyError, AttributeError, RuntimeError):
        return None
    return backend, options


def _init_default_group(backend: str, timeout: timedelta) -> None:
    missing = [name for name in _LAUNCH_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed is not initialised and {', '.join(missing)} are not set: "
                           f"launch with torchrun, or call torch.distributed.init_process_group first")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout)


def initialize_parallel(tp: int = 1, cp: int = 1, dp: int | None = None, backend: str | None = None,
                        timeout_minutes: float = 10.0, ulysses_size: int = 1) -> ParallelState:
    """Build every group once and make it the current state (returned).

    Uses the default process group when one exists (it is then left alone by
    ``destroy_parallel``); otherwise creates it from torchrun's environment. ``dp`` defaults
    to ``world // (tp*cp)``. ``backend`` defaults to nccl when CUDA is available, else gloo.
    ``timeout_minutes`` bounds collectives on the groups created here (fractions of a minute work).
    ``ulysses_size`` > 1 also builds the CP subgroups of hybrid CP (``cp_ulysses``, ``cp_ring``).
    """
    global _STATE
    check_sizes(tp, cp, 1 if dp is None else dp)
    check_ulysses(cp, ulysses_size)
    if not timeout_minutes > 0:
        raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
    if _STATE is not None:
        ulysses = _STATE.cp_ulysses.size if _STATE.cp_ulysses else 1
        if (_STATE.dims == ParallelDims(tp=tp, cp=cp, dp=dp or _STATE.dp.size) and backend in (None, _STATE.backend)
                and ulysses == ulysses_size):
            return _STATE
        raise RuntimeError(f"parallel state already initialised with {_STATE.dims}; "
                           f"call destroy_parallel() before initialising (tp={tp}, cp={cp}, dp={dp})")
    created = not dist.is_initialized()
    if created:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        world = int(os.environ.get("WORLD_SIZE", "0"))  # 0: unknown, _init_default_group explains
    else:
        existing, world = dist.get_backend(), dist.get_world_size()
        if backend is not None and backend != existing:
            raise ValueError(f"the default process group uses backend {existing!r} but backend={backend!r} "
                             f"was requested; pass backend=None or {existing!r}")
        backend = existing
    if world > 0:
        dp = resolve_dp(world, tp, cp, dp)
    timeout = timedelta(minutes=timeout_minutes)
    if created:
        _init_default_group(backend, timeout)
    try:
        dp = resolve_dp(dist.get_world_size(), tp, cp, dp)
        _STATE = _build_state(ParallelDims(tp=tp, cp=cp, dp=dp), backend, timeout, created, ulysses_size)
    except BaseException:
        if created:
            dist.destroy_process_group()
        raise
    return _STATE


def _subgroups(groups: Groups, backend: str, timeout: timedelta) -> AxisGroup:
    """Create every group of ``groups`` (every rank creates all of them, in order) and return this rank's."""
    mine = None
    for ranks in groups:
        override = _subgroup_override(backend, timeout)
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend,
                               pg_options=override[1] if override else None)
        if dist.get_rank() in ranks:
            mine = AxisGroup(size=len(ranks), rank=ranks.index(dist.get_rank()), group=group, ranks=ranks)
    assert mine is not None
    return mine


def _build_state(dims: ParallelDims, backend: str, timeout: timedelta, created: bool,
                 ulysses: int = 1) -> ParallelState:
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    per_dim = {name: _subgroup_override(backend, timeout) for name in dims.mesh_names}
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_names,
                            backend_override=per_dim if per_dim["dp"] else None)
    dp_cp_mesh = mesh[DATA_AXES]._flatten(DATA_AXIS, backend_override=_subgroup_override(backend, timeout))
    tp_cp_mesh = mesh["cp", "tp"]._flatten("tp_cp", backend_override=_subgroup_override(backend, timeout))
    shard_mesh = DeviceMesh.from_group([dp_cp_mesh.get_group(), mesh["tp"].get_group()], device_type,
                                       mesh=torch.arange(dims.world).reshape(dims.data, dims.tp),
                                       mesh_dim_names=(DATA_AXIS, "tp"))
    cp_axis = _axis(mesh["cp"])
    return ParallelState(
        dims=dims, world_size=dist.get_world_size(), rank=dist.get_rank(), backend=backend,
        tp=_axis(mesh["tp"]), cp=cp_axis, dp=_axis(mesh["dp"]), dp_cp=_axis(dp_cp_mesh),
        tp_cp=_axis(tp_cp_mesh), cp_prev_rank=cp_axis.ranks[(cp_axis.rank - 1) % dims.cp],
        cp_next_rank=cp_axis.ranks[(cp_axis.rank + 1) % dims.cp], mesh=mesh, dp_cp_mesh=dp_cp_mesh,
        tp_cp_mesh=tp_cp_mesh, shard_mesh=shard_mesh, owns_default_group=created,
        **_hybrid_axes(dims, ulysses, backend, timeout))


def _hybrid_axes(dims: ParallelDims, ulysses: int, backend: str, timeout: timedelta) -> dict[str, AxisGroup]:
    if ulysses == 1:
        return {}
    groups = compute_rank_groups(dims.world, dims.tp, dims.cp, dims.dp, ulysses)
    return {"cp_ulysses": _subgroups(groups.cp_ulysses, backend, timeout),
            "cp_ring": _subgroups(groups.cp_ring, backend, timeout)}


def destroy_parallel() -> None:
    """Destroy the groups ``initialize_parallel`` created (and the default group only if it created
    that too); a no-op when not initialised."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    _forget_meshes()
    if state.owns_default_group:
        dist.destroy_process_group()
        return
    default = dist.group.WORLD
    seen: set[int] = set()
    for axis in (state.tp, state.cp, state.dp, state.dp_cp, state.tp_cp, state.cp_ulysses, state.cp_ring):
        if axis is not None and axis.group is not default and id(axis.group) not in seen:
            seen.add(id(axis.group))
            dist.destroy_process_group(axis.group)


def _forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches: they compare meshes by shape and names, not by their groups,
    so after a re-initialisation a DTensor op (``nn.Parameter(dtensor)``, say) could return a DTensor on the
    old, destroyed groups. Private torch API: skipped where this torch lacks it."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


@contextmanager
def parallel_context(tp: int = 1, cp: int = 1, dp: int | None = None, backend: str | None = None,
                     timeout_minutes: float = 10.0, ulysses_size: int = 1) -> Iterator[ParallelState]:
    """``initialize_parallel`` for the ``with`` block, ``destroy_parallel`` after it."""
    state = initialize_parallel(tp=tp, cp=cp, dp=dp, backend=backend, timeout_minutes=timeout_minutes,
                                ulysses_size=ulysses_size)
    try:
        yield state
    finally:
        destroy_parallel()


def run_with_parallel(sizes: ParallelDims | tuple[int, ...], fn: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    """``fn(state, *args, **kwargs)`` inside ``parallel_context`` of ``sizes``: a ``ParallelDims``, or the
    test shorthand (tp, cp, dp) / (tp, cp, dp, ulysses_size); for ``SpawnedWorld.run``."""
    tp, cp, dp, *ulysses = (sizes.tp, sizes.cp, sizes.dp) if isinstance(sizes, ParallelDims) else sizes
    with parallel_context(tp, cp, dp, ulysses_size=ulysses[0] if ulysses else 1) as state:
        return fn(state, *args, **kwargs)


def parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    """The current state; RuntimeError before ``initialize_parallel``."""
    if _STATE is None:
        raise RuntimeError("parallel state is not initialised: call "
                           "parallel.state.initialize_parallel(tp=..., cp=..., dp=...) first")
    return _STATE


def get_device_mesh() -> DeviceMesh:
    return get_parallel_state().mesh


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return get_parallel_state().tp.group


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp.rank


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp.size


def get_context_parallel_group() -> dist.ProcessGroup:
    return get_parallel_state().cp.group


def get_context_parallel_rank() -> int:
    return get_parallel_state().cp.rank


def get_context_parallel_world_size() -> int:
    return get_parallel_state().cp.size


def get_context_parallel_global_ranks() -> tuple[int, ...]:
    return get_parallel_state().cp.ranks


def get_hierarchical_context_parallel_groups() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Hybrid CP's (Ulysses group of adjacent CP ranks, ring group across them); (None, None) without."""
    groups = get_parallel_state().cp_groups
    return groups.ulysses, groups.ring


def get_context_parallel_ring_neighbours() -> tuple[int, int]:
    """Global ranks ``(prev, next)`` of this rank in its CP ring."""
    state = get_parallel_state()
    return state.cp_prev_rank, state.cp_next_rank


def _data_axis(with_context_parallel: bool) -> AxisGroup:
    state = get_parallel_state()
    return state.dp_cp if with_context_parallel else state.dp


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The DP group, or the DP x CP group (gradient reduction) when ``with_context_parallel``."""
    return _data_axis(with_context_parallel).group


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _data_axis(with_context_parallel).rank


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _data_axis(with_context_parallel).size


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    return get_parallel_state().tp_cp.group


def get_tensor_and_context_parallel_rank() -> int:
    return get_parallel_state().tp_cp.rank


def get_tensor_and_context_parallel_world_size() -> int:
    return get_parallel_state().tp_cp.size
