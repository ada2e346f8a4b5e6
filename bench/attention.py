"""Context-parallel attention time and memory on CPU, against the local kernel on the same mask.

    python -m bench.attention --seqlens 8192 --worlds 2 4 --layouts zigzag
    python -m bench.attention --worlds 2 4 --layouts zigzag balanced --documents 1 512 corpus
    python -m bench.attention --worlds 2 --layouts zigzag --torch-cp
    python -m bench.attention --worlds 2 4 --layouts zigzag --algorithms ring allgather ulysses hybrid
    python -m bench.attention --worlds 2 --layouts zigzag --documents 1 512 --torch-cp --rounds 3
    python -m bench.attention --seqlens 32768 --worlds 4 --layouts zigzag contiguous --windows 0 4096 \\
        --algorithms ring allgather ulysses --modes fwd_bwd --no-memory --no-local

For each (seqlen, documents, fwd_only) the baseline ``local`` runs the whole sequence in one process with
all ``--threads`` (PyTorch's SDPA for one document; the local kernel on the same per-document mask for
``--documents`` other than 1); each case then runs on ``world`` spawned gloo ranks with ``threads // world``
threads each, in the same command. ``--documents``: ``1`` (one document per sample), a mean document
length (random lengths), or ``corpus`` (the embedded corpus packed as the trainer packs it).
``--torch-cp`` adds PyTorch's own ring attention (all-to-all rotation) on one document;
``--algorithms`` the CP algorithms to time (hybrid: Ulysses groups of ``--ulysses-size``, at cp > that).
``--rounds N`` runs the baseline and every case N times in turn (drift on a shared machine then hits each
round's baseline and cases alike) and reports medians of the per-round figures, with the ratio's range.

Timings run with glibc's default malloc (freed buffers reused, as in training); the memory peaks come from
a second set of ranks started with a 64 KiB mmap threshold, so that RSS follows live memory (one warm-up,
one measured iteration). Columns: ``ratio`` is time over the local run's; ``kernel_ratio`` (``kernels/local``)
the busiest rank's time inside attention kernel calls over the local run's time, so ``ratio -
kernel_ratio`` is what the slowest rank adds outside its kernels (merges, accumulators, copies, waiting
for transfers and for the other ranks); ``mem_ratio`` added memory per
rank (peak RSS minus the RSS before the call) over the local run's; ``vs_1doc`` time over the same case
with one document; ``imbalance`` the busiest rank's share of the mask over the mean (see
``bench/balance.py``); ``sent MB`` what one rank sends per iteration (collectives counted as the share a
ring algorithm sends).

``--windows`` runs every case with each sliding window W (0: full attention) and adds ``vs_full`` (time over
the same case with full attention in the same round) and ``kv_rows`` (K/V rows one rank receives per layer
forward, from the plan; ``rows/(W-1)`` that over the window). ``--no-memory`` skips the memory ranks and
``--no-local`` the local baseline (both are heavy at long sequences).
"""

from __future__ import annotations

import argparse
import contextlib
import os

from bench.attention_cases import DTYPES, time_case
from bench.common import emit, glibc_malloc, median
from cp_train.parallel.cp.algorithms.registry import cp_algorithm_names
from cp_train.parallel.cp.layout import LAYOUTS
from cp_train.parallel.spawn import SpawnedWorld


def spawn(args: argparse.Namespace, world_size: int, live_memory: bool) -> SpawnedWorld:
    """Ranks for timing (glibc's default malloc) or for the memory peak (RSS following live memory)."""
    threads = args.threads if world_size == 1 else max(1, args.threads // world_size)
    with glibc_malloc(live_memory):
        return SpawnedWorld(world_size, threads=threads, timeout_s=3600)


def run_case(worlds: tuple[SpawnedWorld, SpawnedWorld], args: argparse.Namespace, shape: dict, case: str,
             documents: str, fwd_only: bool) -> dict:
    """Time ``case`` on the timing world and measure its peak on the memory world (one warm-up, one run)."""
    timing, memory = worlds
    per_rank = timing.run(time_case, case, shape, documents, fwd_only, args.warmup, args.repeats, args.head_chunks,
                          args.ulysses_size)
    peaks = per_rank if memory is None else memory.run(time_case, case, shape, documents, fwd_only, 1, 1,
                                                       args.head_chunks, args.ulysses_size)
    iteration = [max(r["times"][i] for r in per_rank) for i in range(args.repeats)]  # the slowest rank's
    seconds = median(iteration)
    kernels = [max(r["kernel_times"][i] for r in per_rank) for i in range(args.repeats)
               ] if per_rank[0]["kernel_times"] else None  # the busiest rank's time inside kernel calls
    area = per_rank[0]["area"] or shape["batch"] * shape["seqlen"] * (shape["seqlen"] + 1) // 2
    if not shape["causal"] and per_rank[0]["area"] is None:
        area = shape["batch"] * shape["seqlen"] ** 2
    flops = 4.0 * area * shape["heads"] * shape["head_dim"] * (1.0 if fwd_only else 3.5)
    return {"case": case, "world": timing.world, "threads_per_rank": timing.threads, "documents": documents,
            **shape, "fwd_only": fwd_only, "ms_per_iter": 1000.0 * seconds,
            "kernel_ms": None if kernels is None else 1000.0 * median(kernels),
            "peak_mb_per_rank": max(r["added_mb"] for r in peaks), "tflops": flops / seconds / 1e12,
            "sent_mb_per_rank": max(r["sent_mb"] for r in per_rank), "imbalance": per_rank[0]["imbalance"],
            "kv_rows": max(r["kv_rows"] for r in per_rank),
            "rows_per_window": max(r["kv_rows"] for r in per_rank) / (shape["window"] - 1)
            if shape.get("window", 0) > 1 else None}


def one_round(args: argparse.Namespace, shape: dict, cases: list[str], fwd_only: bool) -> list[dict]:
    """Every ``--documents`` spec: the local baseline, then each case at each world; ratios against this
    round's baseline, ``vs_1doc`` against this round's one-document run of the same case."""
    records: list[dict] = []
    one_doc: dict[tuple, float] = {}
    for documents in args.documents:
        baseline = None
        if args.local:
            with spawn(args, 1, False) as timing, _memory_world(args, 1) as memory:
                baseline = run_case((timing, memory), args, shape, "local", documents, fwd_only)
            records.append(baseline)
        first = len(records) - (baseline is not None)
        for world_size in args.worlds:
            with spawn(args, world_size, False) as timing, _memory_world(args, world_size) as memory:
                for case in cases:
                    if (case == "torch_cp" and documents != "1") or (
                            case.startswith("hybrid") and world_size <= args.ulysses_size):
                        continue
                    record = run_case((timing, memory), args, shape, case, documents, fwd_only)
                    if baseline is not None:
                        record["ratio"] = record["ms_per_iter"] / baseline["ms_per_iter"]
                        record["mem_ratio"] = record["peak_mb_per_rank"] / baseline["peak_mb_per_rank"]
                        if record["kernel_ms"] is not None:
                            record["kernel_ratio"] = record["kernel_ms"] / baseline["ms_per_iter"]
                    records.append(record)
        for record in records[first:]:
            key = (record["case"], record["world"])
            if documents == "1":
                one_doc[key] = record["ms_per_iter"]
            elif key in one_doc:
                record["vs_1doc"] = record["ms_per_iter"] / one_doc[key]
    return records


def _memory_world(args: argparse.Namespace, world_size: int) -> contextlib.AbstractContextManager:
    """The memory ranks, or nothing with ``--no-memory`` (the peaks then come from the timing ranks)."""
    return spawn(args, world_size, True) if args.memory else contextlib.nullcontext()


def with_windows(args: argparse.Namespace, shape: dict, cases: list[str], fwd_only: bool) -> list[dict]:
    """One round at every ``--windows`` W; ``vs_full``: time over the same case's full-attention time."""
    records, full = [], {}
    for window in args.windows:
        for record in one_round(args, {**shape, "window": window}, cases, fwd_only):
            key = (record["case"], record["world"], record["documents"])
            if not window:
                full[key] = record["ms_per_iter"]
            elif key in full:
                record["vs_full"] = record["ms_per_iter"] / full[key]
            records.append(record)
    return records


def combine(rounds: list[list[dict]]) -> list[dict]:
    """One record per case: medians over the rounds of time, memory and the per-round ratios, with the
    spread of ``ratio`` (``ratio_min``, ``ratio_max``). Rounds run the same cases in the same order."""
    combined = []
    for same in zip(*rounds, strict=True):
        record = dict(same[0], rounds=len(same))
        for key in ("ms_per_iter", "kernel_ms", "peak_mb_per_rank", "ratio", "kernel_ratio", "mem_ratio", "vs_1doc",
                    "vs_full"):
            if same[0].get(key) is not None:
                record[key] = median([r[key] for r in same])
        record["tflops"] = same[0]["tflops"] * same[0]["ms_per_iter"] / record["ms_per_iter"]
        if "ratio" in record:
            record["ratio_min"], record["ratio_max"] = min(r["ratio"] for r in same), max(r["ratio"] for r in same)
        combined.append(record)
    return combined


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "stripe"], choices=LAYOUTS)
    parser.add_argument("--documents", nargs="+", default=["1"], help="1, a mean document length, or corpus")
    parser.add_argument("--torch-cp", action="store_true", help="also time PyTorch's own ring attention")
    parser.add_argument("--algorithms", nargs="+", default=["ring"], choices=cp_algorithm_names())
    parser.add_argument("--ulysses-size", type=int, default=2, help="hybrid: CP ranks per Ulysses group")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--non-causal", dest="causal", action="store_false")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="total threads, all ranks")
    parser.add_argument("--head-chunks", type=int, default=None, help="kv-head chunks of the ring (default: by device)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--windows", type=int, nargs="+", default=[0], help="sliding windows W (0: full)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory ranks")
    parser.add_argument("--no-local", dest="local", action="store_false", help="skip the local baseline")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run baseline and cases this many times in turn; report medians of the per-round ratios")
    args = parser.parse_args(argv)
    cases = [f"{algorithm}:{layout}" for algorithm in args.algorithms for layout in args.layouts]
    cases += ["torch_cp"] if args.torch_cp else []
    records = []
    for seqlen in args.seqlens:
        shape = {"batch": args.batch, "seqlen": seqlen, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
                 "head_dim": args.head_dim, "dtype": args.dtype, "causal": args.causal}
        for fwd_only in [mode == "fwd" for mode in args.modes]:
            rounds = [with_windows(args, shape, cases, fwd_only) for _ in range(args.rounds)]
            records.extend(combine(rounds))
    num = lambda digits: (lambda x: "" if x is None else f"{x:.{digits}f}")  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("case", "case", text), ("world", "cp", text), ("seqlen", "seqlen", text), ("window", "W", text),
                   ("documents", "docs", text), ("fwd_only", "fwd_only", text), ("ms_per_iter", "ms/iter", num(1)),
                   ("peak_mb_per_rank", "peak MB/rank", num(1)), ("tflops", "TFLOP/s", num(4)),
                   ("ratio", "ring/local", num(3)), ("ratio_min", "min", num(3)), ("ratio_max", "max", num(3)),
                   ("kernel_ratio", "kernels/local", num(3)),
                   ("mem_ratio", "mem ring/local", num(3)),
                   ("sent_mb_per_rank", "sent MB/rank", num(1)), ("vs_1doc", "vs 1 doc", num(3)),
                   ("imbalance", "imbalance", num(3)), ("vs_full", "vs full", num(3)),
                   ("kv_rows", "K/V rows/rank", text), ("rows_per_window", "rows/(W-1)", num(2))])
    return records


if __name__ == "__main__":
    main()
