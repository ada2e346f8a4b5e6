"""Ring attention throughput and memory on CPU, against the local kernel on the whole sequence.

    python -m bench.attention --seqlens 8192 --worlds 2 4 --layouts zigzag

For each (seqlen, world, layout, fwd_only) the ranks run in spawned gloo
processes with ``threads // world`` threads each; the baseline is PyTorch's
local flash kernel (``scaled_dot_product_attention``, fwd+bwd through
autograd) on the whole sequence in one process with all ``threads``, timed in
the same command. Memory is the per-rank RSS peak minus the RSS just before
the call. Prints one JSON line per configuration, then a table; ``ratio`` is
ring time / local time and ``mem_ratio`` ring added memory / local added memory.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from bench.common import emit, median, peak_memory_mb, reset_peak_memory
from parallel.layout import shard_sequence
from parallel.ring_attention import context_parallel_attention
from parallel.spawn import SpawnedWorld

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def attention_flops(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool, fwd_only: bool) -> float:
    """Matmul FLOPs of attention on the whole sequence: 4*B*S^2*H*D forward, x3.5 with the backward, /2 causal."""
    flops = 4.0 * batch * seqlen * seqlen * heads * head_dim * (1.0 if fwd_only else 3.5)
    return flops / 2 if causal else flops


def time_attention(batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int, dtype: str, causal: bool,
                   layout: str | None, fwd_only: bool, warmup: int, repeats: int) -> dict:
    """Run on every rank: ``layout=None`` is the local kernel on the whole sequence (world of one)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(batch, seqlen, h, head_dim, generator=gen, dtype=DTYPES[dtype])
            for h in (heads, kv_heads, kv_heads, heads)]
    local = full if layout is None else [shard_sequence(x, rank, world, layout) for x in full]
    del full
    q, k, v, dout = local
    for x in (q, k, v):
        x.requires_grad_(not fwd_only)

    def step() -> None:
        with torch.set_grad_enabled(not fwd_only):
            if layout is None:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=heads != kv_heads).transpose(1, 2)
            else:
                out = context_parallel_attention(q, k, v, dist.group.WORLD, layout, causal)
            if not fwd_only:
                out.backward(dout)
        for x in (q, k, v):
            x.grad = None

    times, added = [], []
    for index in range(warmup + repeats):
        if world > 1:
            dist.barrier()
        base = reset_peak_memory()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if index >= warmup:
            times.append(elapsed)
            added.append(peak_memory_mb() - base)
    return {"times": times, "added_mb": median(added)}


def run_config(world: SpawnedWorld, args: argparse.Namespace, seqlen: int, layout: str | None,
               fwd_only: bool) -> dict:
    per_rank = world.run(time_attention, args.batch, seqlen, args.heads, args.kv_heads, args.head_dim,
                         args.dtype, args.causal, layout, fwd_only, args.warmup, args.repeats)
    # one iteration lasts as long as its slowest rank
    iteration = [max(r["times"][i] for r in per_rank) for i in range(args.repeats)]
    seconds = median(iteration)
    flops = attention_flops(args.batch, seqlen, args.heads, args.head_dim, args.causal, fwd_only)
    return {"layout": layout or "local", "world": world.world, "threads_per_rank": world.threads,
            "batch": args.batch, "seqlen": seqlen, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "causal": args.causal, "fwd_only": fwd_only,
            "iters_per_s": 1.0 / seconds, "ms_per_iter": 1000.0 * seconds,
            "peak_mb_per_rank": max(r["added_mb"] for r in per_rank), "tflops": flops / seconds / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "stripe"],
                        choices=["contiguous", "zigzag", "stripe"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--non-causal", dest="causal", action="store_false")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="total threads, all ranks")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.kv_heads = args.kv_heads or args.heads

    records = []
    for seqlen in args.seqlens:
        for fwd_only in [mode == "fwd" for mode in args.modes]:
            with SpawnedWorld(1, threads=args.threads, timeout_s=3600) as local_world:
                baseline = run_config(local_world, args, seqlen, None, fwd_only)
            records.append(baseline)
            for world_size in args.worlds:
                with SpawnedWorld(world_size, threads=max(1, args.threads // world_size), timeout_s=3600) as world:
                    for layout in args.layouts:
                        record = run_config(world, args, seqlen, layout, fwd_only)
                        record["ratio"] = record["ms_per_iter"] / baseline["ms_per_iter"]
                        record["mem_ratio"] = record["peak_mb_per_rank"] / baseline["peak_mb_per_rank"]
                        records.append(record)
    num = lambda digits: (lambda x: "" if x is None else f"{x:.{digits}f}")  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("layout", "layout", text), ("world", "cp", text), ("batch", "batch", text),
                   ("seqlen", "seqlen", text), ("heads", "heads", text), ("head_dim", "head_dim", text),
                   ("fwd_only", "fwd_only", text), ("iters_per_s", "iters/s", num(3)),
                   ("ms_per_iter", "ms/iter", num(1)), ("peak_mb_per_rank", "peak MB/rank", num(1)),
                   ("tflops", "TFLOP/s", num(4)), ("ratio", "ring/local", num(3)),
                   ("mem_ratio", "mem ring/local", num(3))])


if __name__ == "__main__":
    main()
