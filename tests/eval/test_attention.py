"""A planted needle at the attention level (issue 33, test 1), on spawned gloo worlds.

Keys are zero except at needle positions (one on every CP rank's slice), each a unit vector of its own
direction; every query points at one needle at or before it (chosen to sit on another rank where there is
one) with a logit gap of 30. Then ``out_i`` is that needle's value to 1e-3 (the exact weight on the other
keys is at most i * e^-30), and the CP result equals one process's in fp64 to 1e-12, for every algorithm x
layout at cp 1, 2 and 4. The negative control drops the ring steps t > 0 (a mutant patched into the spawned
worker only) and must fail the retrieval check.

With a sliding window W (``window=``), every key is a needle of direction ``position mod (W + 1)`` and each
query aims at the one W - 1 back (retrieved) or W back (outside the window: not retrieved). With sinks
(``sinks=``), the output is exactly the sinkless output scaled by ``sigmoid(lse - s)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from cp_train.parallel.cp import attention as cp_attention
from cp_train.parallel.cp.balanced_layout import balanced_positions
from cp_train.parallel.cp.layout import LAYOUTS, sequence_positions
from cp_train.parallel.cp.ring import forward as ring_forward
from cp_train.parallel.mesh.state import run_with_parallel

GAP = 30.0
SEQ, HEADS, KV_HEADS, DIM = 32, 4, 2, 8
ALGORITHMS = ("ring", "allgather", "ulysses", "hybrid")


def rank_positions(layout: str, rank: int, world: int, seq: int = SEQ) -> torch.Tensor:
    """Global positions of ``rank``'s tokens (the balanced layout with one document per sample)."""
    if world == 1:
        return torch.arange(seq)
    if layout == "balanced":
        return balanced_positions(torch.zeros(seq, dtype=torch.long), world)[rank]
    return sequence_positions(seq, rank, world, layout)


def planted(world: int, layout: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[1, SEQ, H, D]`` float64 and each query's needle position ``[SEQ]``: one needle per rank's
    slice (the first at position 0), queries aimed at a needle on another rank where one precedes them."""
    gen = torch.Generator().manual_seed(seed)
    owner = torch.empty(SEQ, dtype=torch.long)
    for rank in range(world):
        owner[rank_positions(layout, rank, world)] = rank
    needles = sorted({0} | {int(rank_positions(layout, r, world)[1]) for r in range(world)})[:DIM]
    target = torch.empty(SEQ, dtype=torch.long)
    for i in range(SEQ):
        seen = [p for p in needles if p <= i]
        remote = [p for p in seen if owner[p] != owner[i]]
        target[i] = (remote or seen)[int(torch.randint(len(remote or seen), (1,), generator=gen))]
    k = torch.zeros(1, SEQ, KV_HEADS, DIM, dtype=torch.float64)
    q = torch.zeros(1, SEQ, HEADS, DIM, dtype=torch.float64)
    for slot, p in enumerate(needles):
        k[0, p, :, slot] = 1.0
    for i in range(SEQ):
        q[0, i, :, needles.index(int(target[i]))] = GAP * DIM ** 0.5  # the default scale is 1/sqrt(D)
    v = torch.randn(1, SEQ, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    return q, k, v, target


@contextlib.contextmanager
def ring_without_remote_steps() -> Iterator[None]:
    """The mutant: the ring forward computes its local step only (steps t > 0 dropped)."""
    original = ring_forward.forward_step

    def local_only(plan, index, *args, **kwargs):  # noqa: ANN001, ANN202 - forward_step's signature
        if index > 0:
            return None
        return original(plan, index, *args, **kwargs)

    ring_forward.forward_step = local_only
    try:
        yield
    finally:
        ring_forward.forward_step = original


def check_case(groups, world: int, rank: int, algorithm: str, layout: str) -> tuple[float, float]:  # noqa: ANN001
    """(worst |out_i - v_needle(i)|, worst |CP out - one process out|) of one algorithm x layout."""
    q, k, v, target = planted(world, layout)
    mine = rank_positions(layout, rank, world)
    local = [x[:, mine] for x in (q, k, v)]
    extra = {}
    if layout == "balanced" and world > 1:
        extra = {"document_ids": torch.zeros(1, mine.numel(), dtype=torch.long), "position_ids": mine[None]}
    out = cp_attention.context_parallel_attention(*local, groups, layout, True, algorithm=algorithm, **extra)
    alone = cp_attention.context_parallel_attention(q, k, v, None, "contiguous", True)[:, mine]
    expected = v.repeat_interleave(HEADS // KV_HEADS, dim=2)[:, target][:, mine]
    return float((out - expected).abs().max()), float((out - alone).abs().max())


WINDOW = 6


def windowed(distance: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """q, k, v float64: the key at j has direction ``j mod (WINDOW + 1)``, the query at i aims at ``i - distance``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.zeros(1, SEQ, KV_HEADS, DIM, dtype=torch.float64)
    q = torch.zeros(1, SEQ, HEADS, DIM, dtype=torch.float64)
    for j in range(SEQ):
        k[0, j, :, j % (WINDOW + 1)] = 1.0
        q[0, j, :, (j - distance) % (WINDOW + 1)] = GAP * DIM ** 0.5
    return q, k, torch.randn(1, SEQ, KV_HEADS, DIM, generator=gen, dtype=torch.float64)


def check_window_case(groups, world: int, rank: int, algorithm: str, layout: str) -> tuple[float, float]:  # noqa: ANN001
    """(worst |out_i - v_{i-W+1}|, minus the least |out_i - v_{i-W}|) over the queries i >= W, with window W
    (both maxima are the worst over ranks)."""
    mine = rank_positions(layout, rank, world)
    extra = {}
    if layout == "balanced" and world > 1:
        extra = {"document_ids": torch.zeros(1, mine.numel(), dtype=torch.long), "position_ids": mine[None]}
    found = []
    for distance in (WINDOW - 1, WINDOW):
        q, k, v = windowed(distance)
        out = cp_attention.context_parallel_attention(*(x[:, mine] for x in (q, k, v)), groups, layout, True,
                                                      algorithm=algorithm, window=WINDOW, **extra)
        rows = mine >= WINDOW
        target = v.repeat_interleave(HEADS // KV_HEADS, dim=2)[:, mine - distance]
        found.append((out - target)[:, rows].abs().amax(dim=(-1, -2)))
    return float(found[0].max()), -float(found[1].min())


def check_sink_case(groups, world: int, rank: int, algorithm: str, layout: str) -> tuple[float, float]:  # noqa: ANN001
    """(worst |out_sinks - out * sigmoid(lse - s)|, worst |out_sinks - one process's|)."""
    q, k, v, _ = planted(world, layout, seed=2)
    sinks = torch.linspace(-3.0, 35.0, HEADS, dtype=torch.float64)  # around the needle's logit of 30, and below
    mine = rank_positions(layout, rank, world)
    extra = {}
    if layout == "balanced" and world > 1:
        extra = {"document_ids": torch.zeros(1, mine.numel(), dtype=torch.long), "position_ids": mine[None]}
    local = [x[:, mine] for x in (q, k, v)]
    out, lse = cp_attention.context_parallel_attention(*local, groups, layout, True, algorithm=algorithm,
                                                       return_lse=True, **extra)
    sunk = cp_attention.context_parallel_attention(*local, groups, layout, True, algorithm=algorithm, sinks=sinks,
                                                   **extra)
    scale = torch.sigmoid(lse.double().transpose(1, 2) - sinks)[..., None]
    alone = cp_attention.context_parallel_attention(q, k, v, None, "contiguous", True, sinks=sinks)[:, mine]
    return float((sunk - out * scale).abs().max()), float((sunk - alone).abs().max())


CHECKS = {"needle": check_case, "window": check_window_case, "sinks": check_sink_case}


def check_all(state, cases: list[tuple[str, str]], mutant: bool = False,  # noqa: ANN001
              kind: str = "needle") -> dict[tuple[str, str], tuple[float, float]]:
    """``check_case`` of every (algorithm, layout) on this parallel state (spawned worker)."""
    with ring_without_remote_steps() if mutant else contextlib.nullcontext():
        return {case: CHECKS[kind](state.cp_groups, state.cp.size, state.cp.rank, *case) for case in cases}


def _worst(results: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
    return {case: (max(r[case][0] for r in results), max(r[case][1] for r in results)) for case in results[0]}


def test_planted_needle_at_cp1() -> None:
    for algorithm in ALGORITHMS:
        for layout in LAYOUTS:
            retrieval, parity = check_case(None, 1, 0, algorithm, layout)
            assert retrieval < 1e-3 and parity <= 1e-12, (algorithm, layout, retrieval, parity)


@pytest.mark.parametrize("world", [2, 4])
def test_planted_needle_every_algorithm_and_layout(spawn_world, world: int) -> None:
    """Every algorithm x layout retrieves the remote needle and equals one process (fp64); the mutant that
    drops the ring's remote steps fails the retrieval."""
    plain = [(a, layout) for a in ALGORITHMS if a != "hybrid" for layout in LAYOUTS]
    hybrid = [("hybrid", layout) for layout in LAYOUTS]
    spawned = spawn_world(world)
    found = _worst(spawned.run(run_with_parallel, (1, world, 1), check_all, plain))
    found |= _worst(spawned.run(run_with_parallel, (1, world, 1, 2), check_all, hybrid))
    bad = {case: errors for case, errors in found.items() if not (errors[0] < 1e-3 and errors[1] <= 1e-12)}
    assert not bad, bad
    mutant = _worst(spawned.run(run_with_parallel, (1, world, 1), check_all,
                                [("ring", layout) for layout in LAYOUTS], mutant=True))
    caught = {case: errors[0] for case, errors in mutant.items() if errors[0] > 1e-3}
    assert set(caught) == set(mutant), f"the mutant without remote ring steps passed: {mutant}"


@pytest.mark.parametrize("world", [1, 4])
def test_window_and_sinks(spawn_world, world: int) -> None:
    """A needle W - 1 back is retrieved and one W back is not; sinks scale the output by sigmoid(lse - s).
    Every algorithm x layout at cp 4; at cp 1 (where the layout is moot) the contiguous one."""
    cases = [(a, layout) for a in ALGORITHMS for layout in LAYOUTS]
    if world == 1:
        cases = [("ring", "contiguous")]
        window = {case: check_window_case(None, 1, 0, *case) for case in cases}
        sinks = {case: check_sink_case(None, 1, 0, *case) for case in cases}
    else:
        spawned, plain = spawn_world(world), [c for c in cases if c[0] != "hybrid"]
        hybrid = [c for c in cases if c[0] == "hybrid"]
        window, sinks = {}, {}
        for kind, found in (("window", window), ("sinks", sinks)):
            found |= _worst(spawned.run(run_with_parallel, (1, world, 1), check_all, plain, kind=kind))
            found |= _worst(spawned.run(run_with_parallel, (1, world, 1, 2), check_all, hybrid, kind=kind))
    bad = {case: got for case, got in window.items() if not (got[0] < 1e-3 and -got[1] > 0.1)}
    assert not bad, f"window {WINDOW}: (error at W - 1, least error at W): {bad}"
    bad = {case: got for case, got in sinks.items() if not (got[0] <= 1e-12 and got[1] <= 1e-12)}
    assert not bad, f"sinks: (vs out * sigmoid(lse - s), vs one process): {bad}"


def test_mutant_is_only_in_the_worker() -> None:
    assert ring_forward.forward_step.__name__ == "forward_step"
