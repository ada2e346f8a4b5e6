"""Process groups for TP x CP x DP, built once per process on a named DeviceMesh.

Rank order is Megatron's ``tp-cp-dp`` (see ``rank_groups.py`` for the pure
rank-group function, re-exported here). ``initialize_parallel`` creates
the groups (``groups.py``: every rank creates every group, in the same order) and returns a
``ParallelState``; the Megatron-named getters below read that current state. Library
modules receive groups explicitly and never call the getters.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cp_train.parallel.mesh.groups import AxisGroup, ParallelState, build_state, forget_meshes, init_default_group
from cp_train.parallel.mesh.model_parallel import register_grad_group
from cp_train.parallel.mesh.open_files import raise_open_file_limit, sockets_for
from cp_train.parallel.mesh.rank_groups import (  # noqa: F401  (re-exported)
    AXIS_ORDER,
    DATA_AXES,
    DATA_AXIS,
    Groups,
    ParallelDims,
    RankGroups,
    check_replicate,
    check_sizes,
    check_ulysses,
    check_world,
    compute_rank_groups,
    rank_coordinates,
    resolve_dp,
)

_STATE: ParallelState | None = None


def initialize_parallel(tp: int = 1, cp: int = 1, dp: int | None = None, backend: str | None = None,
                        timeout_minutes: float = 10.0, ulysses_size: int = 1, dp_replicate: int = 1) -> ParallelState:
    """Build every group once and make it the current state (returned).

    Uses the default process group when one exists (it is then left alone by
    ``destroy_parallel``); otherwise creates it from torchrun's environment. ``dp`` defaults
    to ``world // (tp*cp)``. ``backend`` defaults to nccl when CUDA is available, else gloo.
    ``timeout_minutes`` bounds collectives on the groups created here (fractions of a minute work).
    ``ulysses_size`` > 1 also builds the CP subgroups of hybrid CP (``cp_ulysses``, ``cp_ring``);
    ``dp_replicate`` > 1 HSDP's groups (FSDP shards over a replica's DP x CP ranks, ``fsdp_shard``, and replicates
    across the ``dp_replicate`` replicas).
    """
    global _STATE
    check_sizes(tp, cp, 1 if dp is None else dp)
    check_ulysses(cp, ulysses_size)
    if not timeout_minutes > 0:
        raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
    if _STATE is not None:
        ulysses = _STATE.cp_ulysses.size if _STATE.cp_ulysses else 1
        if (_STATE.dims == ParallelDims(tp=tp, cp=cp, dp=dp or _STATE.dp.size) and backend in (None, _STATE.backend)
                and ulysses == ulysses_size and _STATE.dp_replicate == dp_replicate):
            return _STATE
        raise RuntimeError(f"parallel state already initialised with {_STATE.dims}; "
                           f"call destroy_parallel() before initialising (tp={tp}, cp={cp}, dp={dp})")
    created = not dist.is_initialized()
    if created:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        world = int(os.environ.get("WORLD_SIZE", "0"))  # 0: unknown, init_default_group explains
    else:
        existing, world = dist.get_backend(), dist.get_world_size()
        if backend is not None and backend != existing:
            raise ValueError(f"the default process group uses backend {existing!r} but backend={backend!r} "
                             f"was requested; pass backend=None or {existing!r}")
        backend = existing
    if world > 0:
        dp = resolve_dp(world, tp, cp, dp)
        raise_open_file_limit(sockets_for(world))  # gloo's groups over every rank: a socket per peer
    timeout = timedelta(minutes=timeout_minutes)
    if created:
        init_default_group(backend, timeout)
    try:
        dp = resolve_dp(dist.get_world_size(), tp, cp, dp)
        check_replicate(dp, dp_replicate)
        _STATE = build_state(ParallelDims(tp=tp, cp=cp, dp=dp), backend, timeout, created, ulysses_size, dp_replicate)
    except BaseException:
        if created:
            dist.destroy_process_group()
        raise
    return _STATE


def destroy_parallel() -> None:
    """Destroy the groups ``initialize_parallel`` created (and the default group only if it created
    that too), and free them: a no-op when not initialised."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    forget_meshes()
    if state.owns_default_group:
        dist.destroy_process_group()
        return
    default = dist.group.WORLD
    seen: set[int] = set()
    ring = state.cp_ring if state.cp_ring is not None else state.cp
    register_grad_group(ring.group, None)
    axes = (state.tp, state.cp, state.dp, state.dp_cp, state.tp_cp, state.cp_ulysses, state.cp_ring,
            state.fsdp_shard, state.dp_replicate_axis, state.cp_grad)
    groups = [axis.group for axis in axes if axis is not None] + [state.host_group]
    for group in groups:
        if group is not None and group is not default and id(group) not in seen:
            seen.add(id(group))
            dist.destroy_process_group(group)
    backend = state.backend
    del state, groups, ring
    # reference cycles hold the destroyed groups until a full collection: without one, each gloo group's threads
    # (``gloo_tcp_loop``, several per group) stay alive and wake, build after build (a process that runs many
    # jobs, as the spawned test worlds do). PyTorch's fake groups (``tests/parallel/layouts_1024.py``, a build per
    # simulated rank) hold no threads: no collection for them
    if backend != "fake":
        gc.collect()


@contextmanager
def parallel_context(tp: int = 1, cp: int = 1, dp: int | None = None, backend: str | None = None,
                     timeout_minutes: float = 10.0, ulysses_size: int = 1, dp_replicate: int = 1
                     ) -> Iterator[ParallelState]:
    """``initialize_parallel`` for the ``with`` block, ``destroy_parallel`` after it. The generator keeps no
    reference to the state, so ``destroy_parallel``'s collection frees its groups (and their gloo threads) unless
    the caller still holds one."""
    try:
        yield initialize_parallel(tp=tp, cp=cp, dp=dp, backend=backend, timeout_minutes=timeout_minutes,
                                  ulysses_size=ulysses_size, dp_replicate=dp_replicate)
    finally:
        destroy_parallel()


@contextmanager
def world_of_one() -> Iterator[None]:
    """Outside a launcher (no ``RANK``): torchrun's variables for a one-process world on a free port for the
    ``with`` block, removed after it, so a second run in the same process plans its own world."""
    if "RANK" in os.environ:
        yield
        return
    from cp_train.parallel.spawn import free_port

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port())})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_with_parallel(sizes: ParallelDims | tuple[int, ...], fn: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    """``fn(state, *args, **kwargs)`` inside ``parallel_context`` of ``sizes``: a ``ParallelDims``, or the
    test shorthand (tp, cp, dp) / (tp, cp, dp, ulysses_size) / (tp, cp, dp, ulysses_size, dp_replicate); for
    ``SpawnedWorld.run``."""
    tp, cp, dp, *rest = (sizes.tp, sizes.cp, sizes.dp) if isinstance(sizes, ParallelDims) else sizes
    ulysses, replicate = (list(rest) + [1, 1])[:2]
    with parallel_context(tp, cp, dp, ulysses_size=ulysses, dp_replicate=replicate):  # no name for the state:
        return fn(get_parallel_state(), *args, **kwargs)  # its groups are freed as the block ends


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
