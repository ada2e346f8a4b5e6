"""The process groups and meshes of one TP x CP x DP layout, and the state that holds them (``ParallelState``).

``build_state`` creates the named DeviceMesh ``("dp", "cp", "tp")``, its flattenings and (for hybrid CP)
the Ulysses and ring subgroups of CP; every rank creates every group, in the same order. ``state.py``
keeps the current state and its Megatron-named getters.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cp_train.parallel.cp.algorithms.registry import CPAlgorithm
from cp_train.parallel.mesh.model_parallel import CPGroups, ModelParallel, register_grad_group
from cp_train.parallel.mesh.open_files import gloo_group_of_every_rank
from cp_train.parallel.mesh.rank_groups import DATA_AXES, DATA_AXIS, Groups, ParallelDims, compute_rank_groups

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
    host_group: dist.ProcessGroup | None = None  # every rank over gloo: host scalars, never the GPU's stream
    dp_replicate: int = 1  # HSDP's replicas (1: FSDP shards over all of DP x CP)
    fsdp_shard: AxisGroup | None = None  # the ranks FSDP shards over: dp_cp, or a replica's DP x CP under HSDP
    dp_replicate_axis: AxisGroup | None = None  # HSDP: this shard's replicas (gradients all-reduced across)
    fsdp_mesh: DeviceMesh | None = None  # what FSDP2 is given: ("dp_cp",), or ("dp_replicate", "dp_shard_cp")
    cp_grad: AxisGroup | None = None  # the ring group's twin: the dK/dV hops (``ring/comm.py``)
    cp_ulysses: AxisGroup | None = None  # hybrid CP: adjacent CP ranks (all-to-all inside)
    cp_ring: AxisGroup | None = None  # hybrid CP: the same place in each Ulysses group (the ring across)

    def model_parallel(self, layout: str = "zigzag", algorithm: str | CPAlgorithm = "ring",
                       sequence_parallel: bool = False) -> ModelParallel:
        """The model's parallel settings on this state's TP and CP groups (``ModelParallel.build`` validates them)."""
        return ModelParallel.build(self.tp.group, self.cp_groups, layout, algorithm, sequence_parallel)

    @property
    def cp_groups(self) -> CPGroups:
        """The CP group and, for hybrid CP, its Ulysses and ring subgroups (what the attention takes)."""
        return CPGroups(self.cp.group, self.cp_ulysses.group if self.cp_ulysses else None,
                        self.cp_ring.group if self.cp_ring else None)


def _axis(mesh: DeviceMesh) -> AxisGroup:
    group = mesh.get_group()
    return AxisGroup(size=dist.get_world_size(group), rank=dist.get_rank(group), group=group,
                     ranks=tuple(dist.get_process_group_ranks(group)))


def _subgroup_override(backend: str, timeout: timedelta, high_priority: bool = False) -> tuple[str, Any] | None:
    """(backend, a NEW options object carrying ``timeout``) for one mesh dimension's groups; None where
    the backend has no options. Call it once per dimension: c10d writes each group's ranks and name
    into its options object, so an object shared by several groups would be overwritten. ``high_priority``:
    NCCL's streams of the groups at high priority (the CP ring's hops)."""
    names = {"gloo": ("ProcessGroupGloo", "_Options"), "nccl": ("ProcessGroupNCCL", "Options")}
    try:
        options = getattr(getattr(dist, names[backend][0]), names[backend][1])()
        options._timeout = timeout
    except (KeyError, AttributeError, RuntimeError):
        return None
    if high_priority and hasattr(options, "is_high_priority_stream"):
        options.is_high_priority_stream = True
    return backend, options


def run_device(backend: str) -> torch.device:
    """This process's compute device: ``cuda:LOCAL_RANK`` under nccl where CUDA is available, else the CPU."""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_default_group(backend: str, timeout: timedelta) -> None:
    """The default group from torchrun's environment; under nccl with CUDA bound to ``cuda:LOCAL_RANK``
    (``device_id``), elsewhere (gloo, CPU) as plain ``init_process_group(backend, timeout=...)``."""
    missing = [name for name in _LAUNCH_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed is not initialised and {', '.join(missing)} are not set: "
                           f"launch with torchrun, or call torch.distributed.init_process_group first")
    device = run_device(backend)
    if device.type == "cuda":  # bind the group to this rank's GPU: NCCL connects eagerly and splits subgroups
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend, timeout=timeout)


def _splits_from_default() -> bool:
    """Whether an axis's groups come from one ``dist.split_group`` call: where the default group is bound to this
    rank's device (``init_default_group`` binds it under NCCL) and its backend there can split. One call is one
    ncclCommSplit of the default group for every group of the axis, as DeviceMesh creates its dims' groups;
    ``new_group`` under a bound NCCL group is a split of the whole world as well, one for each group (each rank
    joins every one of them, as a non-member in all but its own)."""
    default = dist.distributed_c10d._get_default_group()
    device = getattr(default, "bound_device_id", None)
    if device is None or not hasattr(dist, "split_group") or not torch.accelerator.is_available():
        return False
    return bool(getattr(default._get_backend(device), "supports_splitting", False))


def _subgroups(groups: Groups, backend: str, timeout: timedelta, name: str, high_priority: bool = False) -> AxisGroup:
    """Create every group of ``groups`` (every rank, in the same order) and return this rank's: one collective
    split of the default group where it can (``_splits_from_default``), else one ``new_group`` per group. ``name``:
    the groups' description (``group_desc``: what NCCL's logs and PyTorch's flight recorder call them)."""
    me = dist.get_rank()
    ranks = next(members for members in groups if me in members)
    if _splits_from_default():
        override = _subgroup_override(backend, timeout, high_priority)
        group = dist.split_group(split_ranks=[list(members) for members in groups], timeout=timeout,
                                 pg_options=override[1] if override else None, group_desc=name)
    else:
        for members in groups:
            override = _subgroup_override(backend, timeout, high_priority)  # a new options object per group
            created = dist.new_group(list(members), timeout=timeout, backend=backend,
                                     pg_options=override[1] if override else None, group_desc=name)
            if members == ranks:
                group = created
    return AxisGroup(size=len(ranks), rank=ranks.index(me), group=group, ranks=ranks)


def build_state(dims: ParallelDims, backend: str, timeout: timedelta, created: bool,
                 ulysses: int = 1, dp_replicate: int = 1) -> ParallelState:
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    per_dim = {name: _subgroup_override(backend, timeout, high_priority=name == "cp" and ulysses == 1)
               for name in dims.mesh_names}
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_names,
                            backend_override=per_dim if per_dim["dp"] else None)
    dp_cp_mesh = mesh[DATA_AXES]._flatten(DATA_AXIS, backend_override=_subgroup_override(backend, timeout))
    tp_cp_mesh = mesh["cp", "tp"]._flatten("tp_cp", backend_override=_subgroup_override(backend, timeout))
    shard_mesh = DeviceMesh.from_group([dp_cp_mesh.get_group(), mesh["tp"].get_group()], device_type,
                                       mesh=torch.arange(dims.world).reshape(dims.data, dims.tp),
                                       mesh_dim_names=(DATA_AXIS, "tp"))
    hsdp = _hsdp(dims, dp_replicate, backend, timeout, device_type, mesh["tp"].get_group()) if dp_replicate > 1 else {}
    cp_axis = _axis(mesh["cp"])
    state = ParallelState(
        dims=dims, world_size=dist.get_world_size(), rank=dist.get_rank(), backend=backend,
        tp=_axis(mesh["tp"]), cp=cp_axis, dp=_axis(mesh["dp"]), dp_cp=_axis(dp_cp_mesh),
        tp_cp=_axis(tp_cp_mesh), cp_prev_rank=cp_axis.ranks[(cp_axis.rank - 1) % dims.cp],
        cp_next_rank=cp_axis.ranks[(cp_axis.rank + 1) % dims.cp], mesh=mesh, dp_cp_mesh=dp_cp_mesh,
        tp_cp_mesh=tp_cp_mesh, owns_default_group=created, host_group=_host_group(backend, timeout),
        **{"shard_mesh": shard_mesh, "fsdp_mesh": dp_cp_mesh, "fsdp_shard": _axis(dp_cp_mesh), **hsdp},
        **_hybrid_axes(dims, ulysses, backend, timeout))
    state = dataclasses.replace(state, cp_grad=_grad_twin(state, dims, ulysses, backend, timeout))
    connect_groups(state)
    return state


def _grad_twin(state: ParallelState, dims: ParallelDims, ulysses: int, backend: str, timeout: timedelta
               ) -> AxisGroup | None:
    """A second communicator over each ring group's ranks, for the dK/dV hops (``ring/comm.py``), its NCCL streams
    at high priority like the ring group's own; None without a ring."""
    ring = state.cp_ring if state.cp_ring is not None else state.cp
    if ring.size == 1:
        return None
    groups = compute_rank_groups(dims.world, dims.tp, dims.cp, dims.dp, ulysses)
    twin = _subgroups(groups.cp_ring if state.cp_ring is not None else groups.cp, backend, timeout, "cp_grad",
                      high_priority=True)
    register_grad_group(ring.group, twin.group)
    return twin


def _hsdp(dims: ParallelDims, replicas: int, backend: str, timeout: timedelta, device_type: str,
          tp_group: dist.ProcessGroup) -> dict[str, Any]:
    """HSDP's groups and meshes: FSDP shards over a replica's DP x CP ranks and replicates across ``replicas``;
    the checkpoint mesh gains the replicas as a dim of its own (``("dp_replicate", "dp_shard_cp", "tp")``)."""
    groups = compute_rank_groups(dims.world, dims.tp, dims.cp, dims.dp, dp_replicate=replicas)
    shard = _subgroups(groups.dp_shard_cp, backend, timeout, "dp_shard_cp")
    replicate = _subgroups(groups.dp_replicate, backend, timeout, "dp_replicate")
    per_replica = dims.data // replicas
    tp_rank = dist.get_rank() % dims.tp
    fsdp_mesh = DeviceMesh.from_group(
        [replicate.group, shard.group], device_type,
        mesh=tp_rank + dims.tp * torch.arange(dims.data).reshape(replicas, per_replica),
        mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    shard_mesh = DeviceMesh.from_group(
        [replicate.group, shard.group, tp_group], device_type,
        mesh=torch.arange(dims.world).reshape(replicas, per_replica, dims.tp),
        mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"))
    return {"dp_replicate": replicas, "fsdp_shard": shard, "dp_replicate_axis": replicate, "fsdp_mesh": fsdp_mesh,
            "shard_mesh": shard_mesh}


def _host_group(backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """Every rank over gloo, for scalars the host holds (step times, memory, signals): the default group where
    it is gloo already, else a gloo group beside NCCL, so reducing them never waits on (or for) the GPU."""
    if backend in ("gloo", "fake"):  # fake: PyTorch's test backend (no messages; ``tests/parallel/test_layouts_1024``)
        return dist.group.WORLD
    return gloo_group_of_every_rank(timeout)


def _hybrid_axes(dims: ParallelDims, ulysses: int, backend: str, timeout: timedelta) -> dict[str, AxisGroup]:
    if ulysses == 1:
        return {}
    groups = compute_rank_groups(dims.world, dims.tp, dims.cp, dims.dp, ulysses)
    return {"cp_ulysses": _subgroups(groups.cp_ulysses, backend, timeout, "cp_ulysses"),
            "cp_ring": _subgroups(groups.cp_ring, backend, timeout, "cp_ring", high_priority=True)}


def connect_groups(state: ParallelState) -> None:
    """One one-element all-reduce over the group the ring sends on (CP; hybrid CP: its ring subgroup) when it has
    more than one rank. NCCL creates a group's communicator at its first operation, and where that is a batched P2P
    every member must take part; the ring skips hops with nothing to move, so a rank can miss the first one.
    Other groups start with collectives that every member joins, and stay lazy (no unused communicators)."""
    ring = state.cp_ring if state.cp_ring is not None else state.cp
    if ring.size > 1:
        dist.all_reduce(torch.zeros(1, device=run_device(state.backend)), group=ring.group)


def forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches: they compare meshes by shape and names, not by their groups,
    so after a re-initialisation a DTensor op (``nn.Parameter(dtensor)``, say) could return a DTensor on the
    old, destroyed groups. Private torch API: skipped where this torch lacks it."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()
