"""Runs of query rows (``segments.runs``) and their dense-call count, against the rows' intervals themselves."""

from __future__ import annotations

import numpy as np
import torch

from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.cp.plan.segments import Segment, dense_call_count, pack_keys, runs, visible_intervals


def _rows_seen(segment: Segment) -> list[tuple[int, int]]:
    """Each query row's ``[start, stop)`` as the segment's docstring defines it."""
    rows, keys, (k0, k1) = segment.rows, segment.keys, segment.kv
    return [(k0 + (t if segment.slide else 0), k0 + (keys - rows + t + 1) if segment.causal else k1)
            for t in range(rows)]


def _random_intervals(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(rng.integers(1, 40))
    start = np.cumsum(rng.choice([0, 0, 1, 1, 2, 5], n))
    if rng.random() < 0.3:
        stop = start + np.cumsum(rng.choice([0, 1], n)) + rng.integers(0, 3)
    else:
        stop = start + rng.choice([-1, 0, 1, 2, 3, 5], n) + np.cumsum(rng.choice([0, 1, 1, 2], n))
    return torch.from_numpy(start.astype(np.int64)), torch.from_numpy(stop.astype(np.int64))


def test_runs_cover_every_visible_row_once_with_its_interval_and_count_their_dense_calls() -> None:
    rng = np.random.default_rng(0)
    for _ in range(3000):
        start, stop = _random_intervals(rng)
        segments = runs(start, stop)
        seen = {}
        for segment in segments:
            for row, interval in zip(range(*segment.q), _rows_seen(segment), strict=True):
                assert row not in seen
                seen[row] = interval
        visible = {row: (int(a), int(b)) for row, (a, b) in enumerate(zip(start, stop, strict=True)) if b > a}
        assert seen == visible
        for before, after in zip(segments, segments[1:], strict=False):  # a row alone joins the next run if it can
            assert before.q[1] <= after.q[0]
            if before.rows == 1 and after.rows > 1 and before.q[1] == after.q[0]:
                joined = Segment((before.q[0], after.q[1]), (before.kv[0] if after.slide else after.kv[0],
                                                             after.kv[1]), after.causal, after.slide)
                assert _rows_seen(joined) != [seen[row] for row in range(*joined.q)]
        assert dense_call_count(start, stop) == sum(len(segment.dense_calls()) for segment in segments)


def test_a_stripe_rank_against_the_gathered_sequence_is_a_run_per_row_counted_without_segments() -> None:
    """The all-gather plan's case that made one ``Segment`` per query row: the count alone is asked for."""
    world, seqlen = 4, 64
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 30, 14]))
    positions = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)])
    keys, span = pack_keys(docs, positions)
    rows = sequence_positions(seqlen, 1, world, "stripe")
    start, stop = visible_intervals(keys[rows], docs[rows], keys, span, causal=True)
    segments = runs(start, stop)
    assert len(segments) == len(rows)
    assert dense_call_count(start, stop) == sum(len(segment.dense_calls()) for segment in segments)
