"""What one CP rank's plan of a micro-batch of packed documents costs the host, per algorithm and layout.

    python -m bench.plan_cost [--cp 8] [--seq-len 131072] [--median 4096] [--repeats 3]

The data loader's collate (``SamplePlanner``) plans each micro-batch for its rank. This times that call
(``plan_from_gathered``) for every rank of one sample of lognormal documents (``median`` tokens, sigma 1) and
reports the mean over ranks, the best of ``repeats``. ``baseline`` counts the dense calls of every rank's
query rows against the gathered sequence (``batch_plan.work``, the all-gather plan's) by building a ``Segment`` per
run, as before ``segments.dense_call_count``; both must give the same areas and call counts. Prints JSON lines,
then a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/plan_cost.py` from anywhere

import torch  # noqa: E402

from bench.common import emit  # noqa: E402
from bench.cudnn_graphs import lognormal_documents  # noqa: E402
from cp_train.parallel.cp.layout import sequence_positions  # noqa: E402
from cp_train.parallel.cp.plan import batch_plan  # noqa: E402
from cp_train.parallel.cp.plan.segments import dense_call_count, runs  # noqa: E402

LAYOUTS, ALGORITHMS = ("contiguous", "zigzag", "stripe"), ("ring", "allgather", "ulysses")


def _count_by_segments(start: torch.Tensor, stop: torch.Tensor) -> int:
    return sum(len(segment.dense_calls()) for segment in runs(start, stop))


def rank_inputs(seqlen: int, world: int, layout: str, median: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``(docs, positions)`` ``[world, 1, seqlen / world]`` of one sample in ``layout``."""
    docs = lognormal_documents(seqlen, 1, seed=1, median=median)[0]
    positions = torch.cat([torch.arange(int(c)) for c in torch.unique_consecutive(docs, return_counts=True)[1]])
    rows = torch.stack([sequence_positions(seqlen, rank, world, layout) for rank in range(world)])
    return docs[rows][:, None], positions[rows][:, None]


def time_plans(algorithm: str, world: int, docs: torch.Tensor, positions: torch.Tensor,
               repeats: int) -> tuple[float, list]:
    """(mean seconds per rank's plan, best of ``repeats``; every rank's ``(areas, max_calls)``)."""
    best, summary = float("inf"), []
    for _ in range(repeats):
        summary, start = [], time.perf_counter()
        for rank in range(world):
            plan = batch_plan.plan_from_gathered(algorithm, world, rank, 1, True, docs, positions)
            summary.append((plan.areas, plan.max_calls))
        best = min(best, (time.perf_counter() - start) / world)
    return best, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--median", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    records = []
    for layout in LAYOUTS:
        docs, positions = rank_inputs(args.seq_len, args.cp, layout, args.median)
        for algorithm in ALGORITHMS:
            now, plans = time_plans(algorithm, args.cp, docs, positions, args.repeats)
            batch_plan.dense_call_count = _count_by_segments
            try:
                before, baseline_plans = time_plans(algorithm, args.cp, docs, positions, args.repeats)
            finally:
                batch_plan.dense_call_count = dense_call_count
            records.append({"layout": layout, "algorithm": algorithm, "cp": args.cp, "seq_len": args.seq_len,
                            "baseline_ms": 1e3 * before, "now_ms": 1e3 * now, "speedup": before / now,
                            "same_plans": plans == baseline_plans})
    emit(records, [("layout", "layout", str), ("algorithm", "algorithm", str),
                   ("baseline_ms", "baseline ms", lambda v: f"{v:.0f}"), ("now_ms", "now ms", lambda v: f"{v:.0f}"),
                   ("speedup", "speedup", lambda v: f"{v:.1f}x"), ("same_plans", "same plans", str)])


if __name__ == "__main__":
    main()
