"""The strict communication layer of the test suite (``tests/strict_comm.py``) and its negative controls: what
gloo's tags hide fails under it, as it would under NCCL."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from cp_train.parallel.spawn import RankError, SpawnedWorld
from tests.strict_comm import DECLARE, check


def reordered_pair(same_shape: bool) -> list[float]:
    """Rank 0 sends A then B to rank 1 (tags 1, 2); rank 1 posts its receive for B (tag 2) before A's (tag 1):
    gloo pairs them by tag, NCCL by order. Returns what rank 1 received, [A's first value, B's first value]."""
    a, b = torch.full((4,), 1.0), torch.full((4 if same_shape else 8,), 2.0)
    if dist.get_rank() == 0:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 1, tag=1), dist.P2POp(dist.isend, b, 1, tag=2)]):
            work.wait()
        return []
    got_a, got_b = torch.zeros_like(a), torch.zeros_like(b)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got_b, 0, tag=2), dist.P2POp(dist.irecv, got_a, 0, tag=1)])
    for work in works:
        work.wait()
    return [got_a[0].item(), got_b[0].item()]


def mismatched_collective() -> None:
    """Rank 0 all-reduces 4 floats where rank 1 all-reduces 8 (under gloo: an abort; under NCCL: a hang or a
    partly filled buffer)."""
    dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 8))


def rank_dependent_order() -> None:
    """Two all-reduces of the same size, in a different order on each rank (they pair silently)."""
    first, second = torch.ones(3), torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(first)
        dist.broadcast(second, src=0)
    else:
        dist.broadcast(second, src=0)
        dist.all_reduce(first)


def short_message() -> list[float]:
    """Rank 0 sends 4 floats where rank 1 receives into 8 (gloo fills half the buffer; NCCL hangs or does the
    same). Returns what rank 1 received."""
    if dist.get_rank() == 0:
        dist.isend(torch.ones(4), 1).wait()
        return []
    got = torch.zeros(8)
    dist.irecv(got, 0).wait()
    return got.tolist()


def ring_in_order() -> float:
    """A correct ring exchange: every rank sends to the next and receives from the previous."""
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, (rank - 1) % world, tag=7),
                                    dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world, tag=7)])
    for work in works:
        work.wait()
    dist.all_reduce(got)
    return got[0].item()


def through_helpers() -> list[int]:
    """An all-gather through ``parallel/compat.py``'s rename and a max through ``max_over_ranks``; returns the lines
    that issue them."""
    from cp_train.metrics.throughput import max_over_ranks
    from cp_train.parallel.compat import all_gather_single

    every = torch.zeros(2 * dist.get_world_size())
    first = sys._getframe().f_lineno + 1
    all_gather_single(every, torch.ones(2), group=dist.group.WORLD)
    max_over_ranks([float(dist.get_rank())], dist.group.WORLD)
    return [first, first + 1]


@pytest.fixture(scope="module")
def plain():
    with SpawnedWorld(2) as world:
        yield world


def strict() -> SpawnedWorld:
    """A fresh strict world that declares every call before issuing it, whose peers give up quickly once a rank
    has failed."""
    return SpawnedWorld(2, timeout_s=5, layer="tests.strict_comm", env={DECLARE: "1"})


def test_gloo_hides_a_reordered_pair(plain) -> None:
    """The control of the controls: gloo delivers by tag, whatever the order."""
    assert plain.run(reordered_pair, True)[1] == [1.0, 2.0]
    assert plain.run(reordered_pair, False)[1] == [1.0, 2.0]


def test_a_reordered_pair_fails_under_the_strict_layer() -> None:
    with strict() as world, pytest.raises(RankError, match=r"receive 1 from rank 0 .* posts a float32\[8\] buffer but "
                                                            r"send 1 of rank 0 is float32\[4\]"):
        world.run(reordered_pair, False)


def test_a_reordered_pair_of_one_shape_crosses_over_as_under_nccl(spawn_world) -> None:
    """In the suite's shared worlds (no declarations), as in a declaring one."""
    assert spawn_world(2).run(reordered_pair, True)[1] == [2.0, 1.0]  # A's buffer got B: what NCCL would do
    with strict() as world:
        assert world.run(reordered_pair, True)[1] == [2.0, 1.0]


def test_a_partly_filled_buffer_fails_the_job_in_the_shared_worlds(spawn_world) -> None:
    """Without declarations gloo fills half the buffer and returns; the after-job check fails the job."""
    world = spawn_world(2)
    with pytest.raises(RankError, match=r"short_message: point-to-point message 1 from rank 0 to rank 1 on group "
                                        r"\S+ does not pair: rank 0 sent float32\[4\], rank 1 received into "
                                        r"float32\[8\]"):
        world.run(short_message)
    assert not world.broken and world.run(ring_in_order) == [1.0, 1.0]  # the next job runs


def test_a_mismatched_collective_fails_before_it_is_issued() -> None:
    with strict() as world, pytest.raises(RankError, match=r"collective 1 on group .* differs: rank \d issues "
                                                            r"all_reduce float32\[\d\]"):
        world.run(mismatched_collective)


def test_a_rank_dependent_order_fails() -> None:
    with strict() as world:
        with pytest.raises(RankError, match=r"differs: rank \d issues (all_reduce|broadcast)"):
            world.run(rank_dependent_order)


def test_a_correct_ring_passes(spawn_world) -> None:
    assert spawn_world(2).run(ring_in_order) == [1.0, 1.0]


def test_the_suite_cp_attention_runs_under_the_layer(spawn_world) -> None:
    """The shared worlds are strict: a CP ring job's messages and collectives are recorded and checked."""
    from tests import document_cases

    world = spawn_world(2)
    assert max(world.run(document_cases.check_cases, [("zigzag", True, 4, 2, "random")], 64)[0]) < 1e-5
    sent = sum(len(what) for (_, src, _, side), what in world.payloads[0]["messages"].items() if side == "send")
    assert sent >= 2 and any(world.payloads[1]["calls"].values())  # ring hops; the documents' all-gather


def test_the_trace_names_the_line_that_called_a_collective_helper(spawn_world) -> None:
    """Past the thin wrappers a module lists in ``COLLECTIVE_HELPERS``: the job's own lines, not the helpers'."""
    world = spawn_world(2)
    lines = world.run(through_helpers)[0]
    sites = [call.site for calls in world.payloads[0]["calls"].values() for call in calls]
    assert sites == [f"parallel/test_strict_comm.py:{line}" for line in lines], sites


def test_the_after_job_check_names_an_unpaired_message() -> None:
    from cp_train.parallel.mesh.trace import Call

    call = Call("all_reduce", "float32[3]", "x.py:1")
    sent = {"calls": {"g": [call]}, "messages": {("g", 0, 1, "send"): ["float32[4]", "float32[4]"]},
            "members": {"g": (0, 1)}}
    received = {"calls": {"g": [call]}, "messages": {("g", 0, 1, "recv"): ["float32[4]"]}, "members": {"g": (0, 1)}}
    assert check([sent, received]).startswith("point-to-point message 2 from rank 0 to rank 1 on group g does not "
                                               "pair: rank 0 sent float32[4], rank 1 received into nothing")
    assert check([sent, {**received, "calls": {"g": []}}]).startswith(
        "the ranks' collectives on group g (ranks 0, 1) differ at call 1: rank 0: all_reduce float32[3] at x.py:1; "
        "rank 1: nothing")
