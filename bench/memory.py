"""Peak activation memory of one GPT block's forward + backward, against ``mlp_chunks`` and cp.

    python bench/memory.py --seq 8192 --chunks 1 2 4 8 --cps 1 2 4

Every configuration runs in freshly spawned gloo ranks (world = cp; the world is the CP
group) so that glibc reads ``MALLOC_MMAP_THRESHOLD_`` at start-up and RSS follows live
memory. After one warm-up step (parameter gradients and kernel workspaces then belong to
the baseline) each rank resets its RSS high-water mark, runs the block forward + backward
on its ``seq / cp`` tokens and reports the peak minus the RSS before the step; the figure
is the median over repeats of the largest rank. The total sequence length is fixed, so cp
and the chunked MLP are compared on the same work. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/memory.py` from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import emit, median, peak_memory_mb, reset_peak_memory  # noqa: E402  (sets the env the ranks start with)
from cp_train.model.attention import attention_spec  # noqa: E402
from cp_train.model.block import Block, BlockInputs  # noqa: E402
from cp_train.model.config import ModelConfig  # noqa: E402
from cp_train.model.rope import rope_tables  # noqa: E402
from cp_train.parallel.cp.attention import build_cp_plan  # noqa: E402
from cp_train.parallel.cp.layout import sequence_positions  # noqa: E402
from cp_train.parallel.cp.op import plan_handle  # noqa: E402
from cp_train.parallel.mesh.model_parallel import ModelParallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402


def measure_block(config: ModelConfig, layout: str, seq: int, batch: int, repeats: int) -> dict:
    """Run on every rank of a world that is the CP group: peak added MB and seconds of fwd + bwd."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    parallel = ModelParallel.build(cp_group=dist.group.WORLD, layout=layout)
    block = Block(config, 0, parallel)
    local = seq // world
    positions = sequence_positions(seq, rank, world, layout if world > 1 else "contiguous")
    cos, sin = rope_tables(positions.expand(batch, local), config.head_dim, config.rope_theta)
    x = torch.randn(batch, local, config.hidden_size, requires_grad=True)
    dout = torch.randn(batch, local, config.hidden_size)
    plan = build_cp_plan(parallel.cp, parallel.attention_layout, True, local, algorithm=parallel.algorithm)
    spec = attention_spec(config, parallel, x.device, x.dtype, batch, plan)
    inputs = BlockInputs(cos, sin, plan_handle(parallel.cp, spec, plan))
    added, seconds = [], []
    for index in range(1 + repeats):
        dist.barrier()
        base = reset_peak_memory()
        start = time.perf_counter()
        block(x, inputs).backward(dout)
        if index > 0:  # the first step is the warm-up
            seconds.append(time.perf_counter() - start)
            added.append(peak_memory_mb() - base)
    return {"added_mb": added, "seconds": seconds}


def run(config: ModelConfig, cp: int, args: argparse.Namespace) -> dict:
    with SpawnedWorld(cp, threads=max(1, args.threads // cp), timeout_s=3600) as world:
        per_rank = world.run(measure_block, config, args.layout, args.seq, args.batch, args.repeats)
    peak = median([max(r["added_mb"][i] for r in per_rank) for i in range(args.repeats)])
    seconds = median([max(r["seconds"][i] for r in per_rank) for i in range(args.repeats)])
    tokens = args.batch * args.seq // cp
    return {"cp": cp, "mlp_chunks": config.mlp_chunks, "seq": args.seq, "tokens_per_rank": tokens,
            "hidden": config.hidden_size, "ffn": config.ffn_hidden_size, "heads": config.num_heads,
            "kv_heads": config.num_kv_heads, "layout": args.layout,
            "peak_mb_per_rank": peak, "kb_per_token": 1024 * peak / tokens, "ms_fwd_bwd": 1000 * seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192, help="total sequence length (all CP ranks)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "stripe"])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="mlp_chunks at cp = 1")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="cp sizes, at each --cp-chunks")
    parser.add_argument("--cp-chunks", type=int, nargs="+", default=[1, 4], help="mlp_chunks for the cp sweep")
    parser.add_argument("--threads", type=int, default=2, help="total threads, shared by the ranks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    def config(chunks: int) -> ModelConfig:
        return ModelConfig(vocab_size=256, num_layers=1, hidden_size=args.hidden, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn, max_position_embeddings=args.seq,
                           mlp_chunks=chunks)

    runs = [(1, c) for c in args.chunks] + [(cp, c) for c in args.cp_chunks for cp in args.cps]
    records, seen = [], set()
    for cp, chunks in runs:
        if (cp, chunks) in seen:
            continue
        seen.add((cp, chunks))
        config(chunks).validate(1, cp, args.seq, args.layout)
        records.append(run(config(chunks), cp, args))
    base = next(r for r in records if r["cp"] == 1 and r["mlp_chunks"] == 1)["peak_mb_per_rank"]
    for record in records:
        record["vs_cp1_chunks1"] = record["peak_mb_per_rank"] / base
    num = lambda digits: (lambda x: "" if x is None else f"{x:.{digits}f}")  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("cp", "cp", text), ("mlp_chunks", "mlp_chunks", text), ("seq", "seq", text),
                   ("tokens_per_rank", "tokens/rank", text), ("peak_mb_per_rank", "peak MB/rank", num(1)),
                   ("kb_per_token", "KB/token", num(1)), ("vs_cp1_chunks1", "vs cp1 c1", num(3)),
                   ("ms_fwd_bwd", "ms fwd+bwd", num(0))])


if __name__ == "__main__":
    main()
