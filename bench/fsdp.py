"""Training-step time with FSDP2 against DDP, side by side in one run (CPU, gloo, spawned ranks).

    python -m bench.fsdp [--layout 1 2 1] [--steps 12] [--warmup 3]

Every variant is a full ``Trainer`` on the same world, config and data (the cpu-tiny model's shape:
4 layers, hidden 192, vocab 8192, 8 x 256 tokens per step, 2 micro-batches per rank at (1, 2, 1)):
``ddp`` (parallel.fsdp false), ``fsdp`` (ZeRO-3: parameters gathered again in the backward) and
``fsdp-zero2`` (parallel.fsdp_reshard_after_forward false). The variants take turns step by step,
so drift on a shared machine hits them alike; a step's time is the slowest rank's, the figure the
median over the timed steps after the warm-up. Prints JSON lines, then a table with each variant's
time over ``ddp``'s (the ratio of the medians, and ``paired``: the median of the per-round ratios, each
step against the ``ddp`` step just before it, which a slow spell on the machine moves less), its CPU
time per rank and step (every thread of the process, user and system: on
2 shared cores the step is CPU-bound, so extra CPU shows as time) and its measured state bytes per rank.
``--layout 1 1 1`` measures FSDP2's own cost with nothing to communicate (one rank: no DDP either).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/fsdp.py` from anywhere

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import emit  # noqa: E402
from cp_train.config.sources import build_config  # noqa: E402
from cp_train.data.indexed import IndexedDatasetWriter  # noqa: E402
from cp_train.memory.state_bytes import state_bytes  # noqa: E402
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402
from cp_train.trainer import Trainer  # noqa: E402

EOD, VOCAB = 2, 8192
MODEL = {"vocab_size": VOCAB, "num_layers": 4, "hidden_size": 192, "num_heads": 6, "num_kv_heads": 2,
         "ffn_hidden_size": 512, "max_position_embeddings": 512, "tie_embeddings": True}
VARIANTS = {"ddp": {"parallel.fsdp": False}, "fsdp": {"parallel.fsdp": True},
            "fsdp-zero2": {"parallel.fsdp": True, "parallel.fsdp_reshard_after_forward": False}}


def write_corpus(prefix: Path, tokens: int = 400_000, seed: int = 0) -> str:
    """Random documents of 20-600 tokens, each ending with EOD."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        written = 0
        while written < tokens:
            body = rng.integers(4, VOCAB, int(rng.integers(20, 600)))
            writer.add_document(np.append(body, EOD))
            written += body.size + 1
    return str(prefix)


def time_variants(state: ParallelState, prefix: str, root: str, steps: int, warmup: int, seq_len: int,
                  micro_batch: int, global_batch: int, variants: list[str]) -> dict[str, Any]:
    """On every rank: a trainer per variant, then the variants' steps in turn; per variant its step seconds
    (this rank's) and its state bytes after the first step."""
    trainers, batches = {}, {}
    for name in variants:
        overrides = VARIANTS[name]
        values = {f"model.{k}": v for k, v in MODEL.items()}
        values.update({"parallel.tp": state.tp.size, "parallel.cp": state.cp.size, "parallel.dp": state.dp.size,
                       "data.prefix": prefix, "data.eod_id": EOD, "data.seq_len": seq_len, "data.valid_fraction": 0.0,
                       "data.cache_dir": f"{root}/cache", "train.steps": steps + warmup,
                       "model.max_position_embeddings": seq_len, "train.micro_batch_size": micro_batch,
                       "train.global_batch_size": global_batch, "train.dtype": "fp32", "logging.dir": f"{root}/{name}",
                       "logging.wandb": False, "logging.console": False, **overrides})
        trainers[name] = Trainer(build_config([("bench", values)]), state)
        batches[name] = iter(trainers[name].loader)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    held: dict[str, dict[str, int]] = {}
    for step in range(steps + warmup):
        for name, trainer in trainers.items():
            micro_batches = next(batches[name])
            dist.barrier()
            used, start = _cpu_seconds(), time.perf_counter()
            trainer.train_step(micro_batches)
            elapsed = time.perf_counter() - start
            if step >= warmup:
                seconds[name].append(elapsed)
                cpu[name].append(_cpu_seconds() - used)
            if step == 0:
                held[name] = state_bytes(trainer.model, trainer.optimizer)
    return {"seconds": seconds, "cpu": cpu, "held": held}


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread (gloo's included), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", type=int, nargs=3, default=[1, 2, 1], metavar=("TP", "CP", "DP"))
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="total threads, shared by the ranks")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="the first is the baseline")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=8,
                        help="samples per step (micro-batches per rank: global / (micro x dp))")
    args = parser.parse_args()
    tp, cp, dp = args.layout
    world = tp * cp * dp
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # bench.common's memory setting; timed here: glibc's defaults
    with tempfile.TemporaryDirectory(prefix="cp-train-bench-fsdp-") as root:
        prefix = write_corpus(Path(root) / "docs")
        with SpawnedWorld(world, threads=max(1, args.threads // world), timeout_s=3600) as ranks:
            per_rank = ranks.run(run_with_parallel, (tp, cp, dp), time_variants, prefix, root, args.steps,
                                 args.warmup, args.seq_len, args.micro_batch_size, args.global_batch_size,
                                 args.variants)
    records, step_times = [], {}
    for name in args.variants:
        steps = step_times[name] = [max(rank["seconds"][name][i] for rank in per_rank) for i in range(args.steps)]
        held = max(rank["held"][name]["state_bytes"] for rank in per_rank)
        cpu = statistics.mean(statistics.median(rank["cpu"][name]) for rank in per_rank)
        records.append({"variant": name, "tp": tp, "cp": cp, "dp": dp, "seq_len": args.seq_len,
                        "micro_batch": args.micro_batch_size, "global_batch": args.global_batch_size,
                        "steps": args.steps,
                        "step_ms": 1000 * statistics.median(steps), "step_ms_min": 1000 * min(steps),
                        "step_ms_max": 1000 * max(steps), "cpu_ms_per_rank": 1000 * cpu,
                        "state_mb_per_rank": held / 2**20})
    base = records[0]
    for record in records:
        record["vs_ddp"] = record["step_ms"] / base["step_ms"]
        pairs = zip(step_times[record["variant"]], step_times[base["variant"]], strict=True)
        record["paired_vs_ddp"] = statistics.median(mine / theirs for mine, theirs in pairs)
        record["cpu_vs_ddp"] = record["cpu_ms_per_rank"] / base["cpu_ms_per_rank"]
        record["state_vs_ddp"] = record["state_mb_per_rank"] / base["state_mb_per_rank"]
    num = lambda digits: (lambda x: "" if x is None else f"{x:.{digits}f}")  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("variant", "variant", text), ("tp", "tp", text), ("cp", "cp", text), ("dp", "dp", text),
                   ("seq_len", "seq", text), ("micro_batch", "micro", text), ("global_batch", "global", text),
                   ("step_ms", "step ms (median)", num(1)), ("step_ms_min", "min", num(1)),
                   ("step_ms_max", "max", num(1)), ("vs_ddp", "time vs ddp", num(3)),
                   ("paired_vs_ddp", "paired", num(3)),
                   ("cpu_ms_per_rank", "cpu ms/rank", num(1)), ("cpu_vs_ddp", "cpu vs ddp", num(3)),
                   ("state_mb_per_rank", "state MB/rank", num(2)), ("state_vs_ddp", "state vs ddp", num(3))])


if __name__ == "__main__":
    main()
