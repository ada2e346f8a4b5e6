"""The groups of our own (the ring's dK/dV twin, HSDP's shard and replicate groups, hybrid CP's Ulysses and ring
groups) where the default group is bound to the rank's device, as the trainer binds it under NCCL: one
``dist.split_group`` per axis (one ncclCommSplit of the world), not one split per group.

Without NCCL (gloo's own split hangs on strided partitions at 8 ranks in torch 2.13, so it cannot stand in):
``split_group`` is replaced by a stand-in that takes only what torch's accepts (bound to its signature), checks
what NCCL's split needs (every rank calls with the same partition of disjoint, non-empty rank lists, and the
backend's options carrying the timeout) and makes the partition's groups with gloo. The groups must match the
pure rank-group functions and carry an all-reduce and a ring hop, the same on every rank; the same layouts built
with one ``new_group`` per group must give the same members.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from cp_train.parallel.mesh import groups as process_groups
from cp_train.parallel.mesh.rank_groups import compute_rank_groups
from cp_train.parallel.mesh.state import destroy_parallel, initialize_parallel

# (tp, cp, dp, ulysses_size, dp_replicate): hybrid CP over HSDP, and the ring's twin under tp x cp x dp with HSDP
LAYOUTS = ((1, 4, 2, 2, 2), (2, 2, 2, 1, 2))


def _own_axes(state: Any, tp: int, cp: int, dp: int, ulysses: int, replicas: int) -> dict[str, tuple]:
    """name -> (this rank's AxisGroup, the axis's computed groups) for every axis ``_subgroups`` builds."""
    pure = compute_rank_groups(dp * cp * tp, tp, cp, dp, ulysses, dp_replicate=replicas)
    axes = {"cp_grad": (state.cp_grad, pure.cp_ring if ulysses > 1 else pure.cp),
            "dp_shard_cp": (state.fsdp_shard, pure.dp_shard_cp),
            "dp_replicate": (state.dp_replicate_axis, pure.dp_replicate)}
    if ulysses > 1:
        axes.update({"cp_ulysses": (state.cp_ulysses, pure.cp_ulysses), "cp_ring": (state.cp_ring, pure.cp_ring)})
    return axes


def _check_groups(state: Any, layout: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each own axis: members as computed, an all-reduce of the members' ranks, one hop around it; its members."""
    me, members = dist.get_rank(), {}
    for name, (axis, computed) in _own_axes(state, *layout).items():
        mine = next(group for group in computed if me in group)
        assert axis.ranks == mine == tuple(dist.get_process_group_ranks(axis.group)), (name, axis.ranks, mine)
        assert axis.rank == dist.get_rank(axis.group) == mine.index(me), name
        assert axis.group.group_desc == name, (name, axis.group.group_desc)  # what NCCL's logs call it
        total = torch.tensor([float(me)])
        dist.all_reduce(total, group=axis.group)
        assert total.item() == sum(mine), (name, total.item())
        got = torch.zeros(1)
        after, before = mine[(axis.rank + 1) % axis.size], mine[(axis.rank - 1) % axis.size]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([float(me)]), after, axis.group),
                                            dist.P2POp(dist.irecv, got, before, axis.group)]):
            work.wait()
        assert got.item() == before, (name, got.item(), before)
        members[name] = axis.ranks
    return members


def build_on_rank(layout: tuple[int, ...], split: bool) -> dict[str, Any]:
    """Build ``layout`` taking the split (``split``, through the stand-in) or one ``new_group`` per group; the
    partitions ``split_group`` was called with, the ``dist.new_group`` calls made outside it (DeviceMesh's own
    are not seen: it calls c10d's), each own axis's members."""
    tp, cp, dp, ulysses, replicas = layout
    saved = (dist.split_group, dist.new_group, process_groups._splits_from_default)
    splits: list[list[list[int]]] = []
    outside = [0]  # new_group calls not made by the stand-in

    def split_group(*args: Any, **kwargs: Any) -> Any:
        call = inspect.signature(saved[0]).bind(*args, **kwargs).arguments  # a call torch's split_group takes
        parts, options = call["split_ranks"], call["pg_options"]
        flat = [rank for part in parts for rank in part]
        assert all(parts) and len(flat) == len(set(flat)) and all(isinstance(rank, int) for rank in flat), parts
        assert isinstance(options, dist.ProcessGroupGloo._Options) and options._timeout == call["timeout"], options
        splits.append(parts)
        mine = None
        for part in parts:  # gloo: the partition's groups one by one, every rank creating each
            group = saved[1](part, timeout=call["timeout"], group_desc=call["group_desc"])
            mine = group if dist.get_rank() in part else mine
        return mine

    def new_group(*args: Any, **kwargs: Any) -> Any:
        outside[0] += 1
        return saved[1](*args, **kwargs)

    dist.split_group, dist.new_group = split_group, new_group
    process_groups._splits_from_default = lambda: split
    try:
        state = initialize_parallel(tp=tp, cp=cp, dp=dp, ulysses_size=ulysses, dp_replicate=replicas)
        try:
            members = _check_groups(state, layout)
        finally:
            destroy_parallel()
    finally:
        dist.split_group, dist.new_group, process_groups._splits_from_default = saved
    return {"splits": splits, "new_groups": outside[0], "members": members}


def splits_where_bound(accelerator: bool) -> bool:
    """``_splits_from_default`` with this world's default group bound to ``cpu:0`` (gloo can split) and the
    accelerator reported present or not; the binding and the accelerator restored after."""
    default, available = dist.distributed_c10d._get_default_group(), torch.accelerator.is_available
    torch.accelerator.is_available = lambda: accelerator
    default.bound_device_id = torch.device("cpu", 0)
    try:
        return process_groups._splits_from_default()
    finally:
        default.bound_device_id = None
        torch.accelerator.is_available = available


def test_a_bound_default_group_splits_each_axis_once(spawn_world) -> None:
    world = spawn_world(8)
    for layout in LAYOUTS:
        tp, cp, dp, ulysses, replicas = layout
        split = world.run(build_on_rank, layout, True)
        one_by_one = world.run(build_on_rank, layout, False)
        pure = compute_rank_groups(8, tp, cp, dp, ulysses, dp_replicate=replicas)
        hybrid = [pure.cp_ulysses, pure.cp_ring] if ulysses > 1 else []
        axes = [pure.dp_shard_cp, pure.dp_replicate, *hybrid, pure.cp_ring if ulysses > 1 else pure.cp]  # built so
        for rank in range(8):
            assert split[rank]["splits"] == [[list(group) for group in axis] for axis in axes], (layout, rank)
            assert split[rank]["new_groups"] == 0, (layout, rank, split[rank]["new_groups"])
            own = sum(map(len, axes))  # when not split: one new_group per group of the own axes
            assert one_by_one[rank]["splits"] == [] and one_by_one[rank]["new_groups"] == own, (layout, rank)
            assert split[rank]["members"] == one_by_one[rank]["members"], (layout, rank)
        assert len(split[0]["members"]) == (5 if ulysses > 1 else 3)


def test_the_split_is_taken_where_the_default_group_is_bound_on_an_accelerator(spawn_world) -> None:
    """Bound with an accelerator: split; not bound (the suite's worlds; checked after the binding is undone), or
    no accelerator: one group at a time."""
    world = spawn_world(2)
    assert world.run(splits_where_bound, True) == [True, True]
    assert world.run(splits_where_bound, False) == [False, False]
    assert world.run(process_groups._splits_from_default) == [False, False]
