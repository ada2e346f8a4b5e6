"""Parallel state: pure rank groups vs brute force, real groups on a spawned world of 8, errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from cp_train.parallel.mesh import state as ps
from cp_train.parallel.mesh.state import compute_rank_groups, initialize_parallel, rank_coordinates


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (tp, cp, dp) with tp*cp*dp == world."""
    return [(tp, cp, world // (tp * cp)) for tp in range(1, world + 1) for cp in range(1, world + 1)
            if world % (tp * cp) == 0]


def brute_force_groups(world: int, tp: int, cp: int, dp: int) -> dict[str, set[tuple[int, ...]]]:
    grid = np.arange(world).reshape(dp, cp, tp)
    def as_set(rows: np.ndarray) -> set[tuple[int, ...]]:
        return {tuple(sorted(int(r) for r in row)) for row in rows}
    return {
        "tp": as_set(grid.reshape(-1, tp)),
        "cp": as_set(grid.transpose(0, 2, 1).reshape(-1, cp)),
        "dp": as_set(grid.transpose(1, 2, 0).reshape(-1, dp)),
        "dp_cp": as_set(grid.transpose(2, 0, 1).reshape(-1, dp * cp)),
        "tp_cp": as_set(grid.reshape(dp, cp * tp)),
    }


GROUP_KINDS = ("tp", "cp", "dp", "dp_cp", "tp_cp")


def test_golden_groups_world8_tp2_cp2_dp2() -> None:
    groups = compute_rank_groups(8, tp=2, cp=2, dp=2)
    assert groups.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert groups.cp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert groups.dp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert groups.dp_cp == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert groups.tp_cp == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize("world", range(1, 17))
def test_groups_match_brute_force(world: int) -> None:
    for tp, cp, dp in layouts(world):
        groups = compute_rank_groups(world, tp, cp, dp)
        expected = brute_force_groups(world, tp, cp, dp)
        for kind in GROUP_KINDS:
            got = getattr(groups, kind)
            assert set(got) == expected[kind], (kind, tp, cp, dp, got)
            assert list(got) == sorted(got), f"{kind} groups not ordered by first member: {got}"
            assert sorted(r for g in got for r in g) == list(range(world)), f"{kind} is not a partition"
        for rank in range(world):
            tp_rank, cp_rank, dp_rank = rank_coordinates(rank, tp, cp, dp)
            assert rank == tp_rank + tp * (cp_rank + cp * dp_rank), (rank, tp, cp, dp)


@pytest.mark.parametrize("args,message", [
    ((8, 2, 2, 3), r"world size 8 != tp\*cp\*dp = 2\*2\*3 = 12"),
    ((8, 0, 4, 2), r"tp must be an integer >= 1, got 0"),
    ((8, 2, -1, 2), r"cp must be an integer >= 1, got -1"),
    ((8, 2, 2, 2.0), r"dp must be an integer >= 1, got 2.0"),
])
def test_compute_rank_groups_rejects_bad_sizes(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_rank_groups(*args)


def test_rank_coordinates_rejects_rank_outside_world() -> None:
    with pytest.raises(ValueError, match=r"rank 8 is outside the world of size tp\*cp\*dp = 8"):
        rank_coordinates(8, 2, 2, 2)


GETTERS = [ps.get_parallel_state, ps.get_device_mesh, ps.get_tensor_model_parallel_group,
           ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size,
           ps.get_context_parallel_group, ps.get_context_parallel_rank,
           ps.get_context_parallel_world_size, ps.get_context_parallel_global_ranks,
           ps.get_context_parallel_ring_neighbours, ps.get_data_parallel_group,
           ps.get_data_parallel_rank, ps.get_data_parallel_world_size,
           ps.get_tensor_and_context_parallel_group, ps.get_tensor_and_context_parallel_rank,
           ps.get_tensor_and_context_parallel_world_size]


@pytest.mark.parametrize("getter", GETTERS, ids=lambda g: g.__name__)
def test_getters_before_initialisation_raise(getter) -> None:
    assert not ps.parallel_is_initialized()
    with pytest.raises(RuntimeError, match="call parallel.state.initialize_parallel"):
        getter()


# ----------------------------------------------------------------------------- spawned world of 8

def _check_axis(name: str, axis: ps.AxisGroup, expected_groups: tuple[tuple[int, ...], ...],
                expected_rank: int, me: int) -> None:
    mine = [g for g in expected_groups if me in g]
    assert len(mine) == 1, f"{name}: rank {me} is in {len(mine)} computed groups"
    assert axis.ranks == mine[0], f"{name}: members {axis.ranks}, computed {mine[0]}"
    assert tuple(dist.get_process_group_ranks(axis.group)) == mine[0], f"{name}: process group members"
    assert axis.size == len(mine[0]) == dist.get_world_size(axis.group), f"{name}: size {axis.size}"
    assert axis.rank == expected_rank == dist.get_rank(axis.group), \
        f"{name}: group rank {axis.rank}, expected {expected_rank}"
    total = torch.tensor([float(me)])
    dist.all_reduce(total, group=axis.group)  # the group really connects exactly these ranks
    want = sum(mine[0])
    assert total.item() == want, f"{name}: all-reduce of the members' ranks gave {total.item()}, not {want}"


def check_layout_on_rank(tp: int, cp: int, dp: int) -> None:
    world, me = dist.get_world_size(), dist.get_rank()
    groups = compute_rank_groups(world, tp, cp, dp)
    tp_rank, cp_rank, dp_rank = rank_coordinates(me, tp, cp, dp)
    state = initialize_parallel(tp=tp, cp=cp, dp=dp)
    try:
        assert not state.owns_default_group
        assert initialize_parallel(tp=tp, cp=cp) is state, "same sizes again must return the same state"
        _check_axis("tp", state.tp, groups.tp, tp_rank, me)
        _check_axis("cp", state.cp, groups.cp, cp_rank, me)
        _check_axis("dp", state.dp, groups.dp, dp_rank, me)
        _check_axis("dp_cp", state.dp_cp, groups.dp_cp, cp_rank + cp * dp_rank, me)
        _check_axis("tp_cp", state.tp_cp, groups.tp_cp, tp_rank + tp * cp_rank, me)
        ring = state.cp.ranks
        neighbours = (ring[(cp_rank - 1) % cp], ring[(cp_rank + 1) % cp])
        assert (state.cp_prev_rank, state.cp_next_rank) == neighbours, (state.cp_prev_rank, neighbours)
        mesh = state.mesh
        assert mesh.mesh_dim_names == ("dp", "cp", "tp")
        assert torch.equal(mesh.mesh.cpu(), torch.arange(world).reshape(dp, cp, tp)), mesh.mesh
        assert list(mesh.get_coordinate()) == [dp_rank, cp_rank, tp_rank], mesh.get_coordinate()
        for dim, axis in (("tp", state.tp), ("cp", state.cp), ("dp", state.dp)):
            assert tuple(dist.get_process_group_ranks(mesh.get_group(dim))) == axis.ranks, dim
        assert tuple(state.dp_cp_mesh.mesh.flatten().tolist()) == state.dp_cp.ranks
        assert tuple(state.tp_cp_mesh.mesh.flatten().tolist()) == state.tp_cp.ranks
        # Megatron-named getters read the same state
        assert ps.get_tensor_model_parallel_group() is state.tp.group
        assert ps.get_tensor_model_parallel_rank() == tp_rank
        assert ps.get_tensor_model_parallel_world_size() == tp
        assert ps.get_context_parallel_group() is state.cp.group
        assert (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()) == (cp_rank, cp)
        assert ps.get_context_parallel_global_ranks() == state.cp.ranks
        assert ps.get_context_parallel_ring_neighbours() == (state.cp_prev_rank, state.cp_next_rank)
        assert ps.get_data_parallel_group() is state.dp.group
        assert (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()) == (dp_rank, dp)
        assert ps.get_data_parallel_group(with_context_parallel=True) is state.dp_cp.group
        assert ps.get_data_parallel_world_size(with_context_parallel=True) == dp * cp
        assert ps.get_data_parallel_rank(with_context_parallel=True) == state.dp_cp.rank
        assert ps.get_tensor_and_context_parallel_group() is state.tp_cp.group
        assert ps.get_tensor_and_context_parallel_world_size() == tp * cp
        assert ps.get_tensor_and_context_parallel_rank() == state.tp_cp.rank
        assert ps.get_device_mesh() is mesh
    finally:
        ps.destroy_parallel()
    assert not ps.parallel_is_initialized()


def check_all_layouts_and_errors_on_rank() -> int:
    world = dist.get_world_size()
    for tp, cp, dp in layouts(world):
        check_layout_on_rank(tp, cp, dp)
    check_layout_on_rank(2, 2, 2)  # the same layout again after destroy builds fresh groups
    # DTensor works on the named mesh
    with ps.parallel_context(tp=4, cp=1) as state:
        full = torch.arange(32.0).reshape(8, 4)
        local = distribute_tensor(full, state.mesh["tp"], [Shard(0)]).to_local()
        assert torch.equal(local, full.chunk(4)[state.tp.rank]), local
    # bad input
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tp\*cp = 3\*1 = 3"):
        initialize_parallel(tp=3)
    with pytest.raises(ValueError, match=r"world size 8 != tp\*cp\*dp = 2\*2\*4 = 16"):
        initialize_parallel(tp=2, cp=2, dp=4)
    with pytest.raises(ValueError, match="default process group uses backend 'gloo'"):
        initialize_parallel(tp=2, backend="nccl")
    initialize_parallel(tp=2, cp=2)
    try:
        with pytest.raises(RuntimeError, match=r"already initialised with tp=2, cp=2, dp=2"):
            initialize_parallel(tp=4, cp=2)
    finally:
        ps.destroy_parallel()
    ps.destroy_parallel()  # a second destroy is a no-op
    # the spawned world's default group survives every destroy_parallel
    assert dist.is_initialized()
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world, f"default group all-reduce gave {total.item()}"
    return len(layouts(world))


def describe_state_on_rank(state: ps.ParallelState, tag: str) -> tuple[str, tuple[int, ...], int, int]:
    return tag, state.cp.ranks, state.cp_prev_rank, state.cp_next_rank


def test_spawned_world8_groups_match_computed_coordinates(spawn_world) -> None:
    world = spawn_world(8)
    assert world.run(check_all_layouts_and_errors_on_rank) == [10] * 8
    results = world.run(ps.run_with_parallel, (2, 2, 2), describe_state_on_rank, "golden")
    cp_groups = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3), 4: (4, 6), 5: (5, 7), 6: (4, 6), 7: (5, 7)}
    for rank, (tag, cp_ranks, prev_rank, next_rank) in enumerate(results):
        assert tag == "golden" and cp_ranks == cp_groups[rank], (rank, cp_ranks)
        other = cp_groups[rank][1 - cp_groups[rank].index(rank)]
        assert prev_rank == next_rank == other, (rank, prev_rank, next_rank)


def gloo_loops() -> int:
    """This process's gloo event-loop threads (each wakes about 100 times a second, idle or not)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return names.count("gloo_tcp_loop")


def loops_after_reinitialising(times: int) -> list[int]:
    """This process's gloo loops before and after each of ``times`` builds and destroys of a tp 2 x cp 2 layout
    (every axis's groups and the ring's dK/dV twin), half through ``parallel_context`` and half through
    ``run_with_parallel`` (the spawned worlds' jobs)."""
    counts = [gloo_loops()]
    for n in range(times):
        if n % 2:
            ps.run_with_parallel((2, 2, 1), lambda state: state.tp.size)
        else:
            with ps.parallel_context(tp=2, cp=2):
                pass
        counts.append(gloo_loops())
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_destroyed_groups_leave_no_threads_behind(spawn_world) -> None:
    """A process that builds the parallel state again and again (a spawned test world, a notebook) keeps no
    gloo loop of a destroyed group: before ``destroy_parallel`` freed the groups, each build left ~15 threads
    behind per rank, and until the context kept no reference to the state, the last build's 5 loops a rank."""
    for counts in spawn_world(4).run(loops_after_reinitialising, 4):
        assert counts[0] >= 1 and set(counts) == {counts[0]}, counts


@pytest.mark.parametrize("world", [4, 8, 12, 16])
def test_hybrid_cp_subgroups_match_brute_force(world: int) -> None:
    """Ulysses groups are adjacent CP ranks; ring groups take the same place in every Ulysses group; both
    partition every CP group."""
    for tp, cp, dp in layouts(world):
        for ulysses in (u for u in range(1, cp + 1) if cp % u == 0):
            groups = compute_rank_groups(world, tp, cp, dp, ulysses)
            expected_ulysses, expected_ring = set(), set()
            for cp_group in groups.cp:  # members in CP-rank order
                parts = [cp_group[i:i + ulysses] for i in range(0, cp, ulysses)]
                expected_ulysses |= {tuple(part) for part in parts}
                expected_ring |= {tuple(part[i] for part in parts) for i in range(ulysses)}
            assert set(groups.cp_ulysses) == expected_ulysses and set(groups.cp_ring) == expected_ring
            assert sorted(r for g in groups.cp_ulysses for r in g) == list(range(world))


def test_ulysses_size_must_divide_cp() -> None:
    with pytest.raises(ValueError, match=r"parallel.ulysses_size 3 does not divide parallel.cp 4"):
        compute_rank_groups(8, 2, 4, 1, ulysses=3)


def describe_hybrid_on_rank(state: ps.ParallelState) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    ulysses, ring = ps.get_hierarchical_context_parallel_groups()
    total = torch.ones(1)
    dist.all_reduce(total, group=ulysses)  # the groups are live
    return state.cp_ulysses.ranks, state.cp_ring.ranks, int(total.item())


def test_spawned_hybrid_subgroups(spawn_world) -> None:
    results = spawn_world(8).run(ps.run_with_parallel, (2, 4, 1, 2), describe_hybrid_on_rank)
    assert results[0] == ((0, 2), (0, 4), 2) and results[3] == ((1, 3), (3, 7), 2)
    assert results[6] == ((4, 6), (2, 6), 2)


def groups_connected_on_rank(tp: int, cp: int, dp: int, ulysses: int) -> tuple[int, int]:
    """(groups all-reduced while the state was built, groups expected: the ring's, if it has more than one rank)."""
    reduced, all_reduce = [], dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        reduced.append(group)
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording
    try:
        state = initialize_parallel(tp=tp, cp=cp, dp=dp, ulysses_size=ulysses)
    finally:
        dist.all_reduce = all_reduce
    try:
        ring = state.cp_ring if state.cp_ring is not None else state.cp
        expected = [ring.group] if ring.size > 1 else []
        assert reduced == expected, (reduced, expected)
        return len(reduced), len(expected)
    finally:
        ps.destroy_parallel()


def test_ring_groups_carry_a_collective_before_the_first_ring_hop(spawn_world) -> None:
    """NCCL needs every member in a group's first batched P2P, and the ring skips empty hops: the group the ring
    sends on (CP; hybrid: its ring subgroup) is connected by one all-reduce when the state is built, no other."""
    world = spawn_world(8)
    assert world.run(groups_connected_on_rank, 2, 4, 1, 2) == [(1, 1)] * 8  # hybrid: the ring subgroup
    assert world.run(groups_connected_on_rank, 1, 2, 4, 1) == [(1, 1)] * 8
    assert world.run(groups_connected_on_rank, 8, 1, 1, 1) == [(0, 0)] * 8  # cp = 1: no ring
