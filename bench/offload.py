"""Activation offload on one GPU (``model.activation_offload``): the longest sequence the 1B config trains without
it, then with it at that length (the overlap) and at twice that length.

    python -m bench.offload                            # gpt-1b, selective checkpointing, from 32k tokens up
    python -m bench.offload --seq 131072               # skip the search: this length and twice it
    python -m bench.offload --device cpu --tiny        # the same code on CPU at toy sizes (a smoke test)

One optimizer step of ``launch/configs/gpt-1b-128k-cp8.yaml``'s model (vocabulary 32768, as ``bench/gpu.py``) at
cp 1, micro batch 1, two packed documents, bf16 autocast, fused AdamW, eager, with ``--checkpointing`` (default
selective). Without ``--seq``: the sequence doubles from ``--start`` until a step without offload runs out of
device memory; the last that ran is ``S``. Then, each after a warm-up step, the median of ``--repeats`` steps:
without offload at ``S``, with ``--offload`` (default checkpointed) at ``S`` and at ``2 S``. Per case: peak device
memory (``torch.cuda.max_memory_allocated``, and ``max_memory_reserved`` with the allocator's retries: offloaded
memory not reused in time shows there), step time, tokens/s, the host bytes and the copies fetched late
(not prefetched) of the offload's last forward, and ``vs none``: the step time over the step without offload at the
same length (the issue asks for <= 1.15: the copies hidden behind the blocks' compute). ``2 S`` without offload
is tried too and reported as ``OOM`` when it does not fit. An offload case whose pinned host memory (scaled from
the longest offload case that ran) would pass 90% of the host's available memory is not run: ``OOM`` with the
reason under ``not run``. JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from bench.common import emit, progress
from bench.gpu import time_call
from cp_train.config.sources import load_config
from cp_train.model import GPTModel
from cp_train.parallel import offload

CONFIG = "launch/configs/gpt-1b-128k-cp8.yaml"


def _model(args: argparse.Namespace, seq: int, mode: str, device: torch.device) -> GPTModel:
    config = load_config(CONFIG).model
    config.vocab_size = 32768
    if args.tiny:
        config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads = 3, 64, 4, 2
        config.ffn_hidden_size, config.vocab_size = 128, 512
    config.activation_checkpointing, config.activation_offload = args.checkpointing, mode
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    return GPTModel(config, device=device)


def _step_case(args: argparse.Namespace, seq: int, mode: str, device: torch.device, repeats: int) -> dict:
    model = _model(args, seq, mode, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, seq + 1), generator=gen, device=device)
    documents = torch.zeros(1, seq, dtype=torch.long)
    documents[:, seq // 3:] = 1  # two documents: the varlen path
    plan = model.build_cp_plan(seq, documents)  # on the CPU, as the loader's workers build it
    plan = plan.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else plan
    seen: list[offload.OffloadStats] = []

    def step() -> None:
        with offload.observe() as stats, torch.autocast(device.type, dtype=torch.bfloat16,
                                                         enabled=device.type == "cuda"):
            losses = model(tokens[:, :-1], labels=tokens[:, 1:], plan=plan)
        seen[:] = stats  # this forward's offload, counted on through its backward
        losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)  # the retries counted from here
    seconds = time_call(step, device, args.warmup, repeats)
    stats = seen[-1] if seen else offload.OffloadStats()
    cuda = device.type == "cuda"  # reserved: what the allocator holds (freed memory not reused yet counts there)
    return {"ms": 1000 * seconds, "tokens_per_s": seq / seconds, "oom": False,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else math.nan,
            "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else math.nan,
            "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else None,
            "host_gib": stats.host_bytes / 2**30, "fetched_late": stats.fetched_late, "peak_layers": stats.peak_layers}


def measure(args: argparse.Namespace, seq: int, mode: str, device: torch.device, repeats: int | None = None
            ) -> dict:
    """One case: the median step of ``repeats`` (default ``--repeats``) after ``--warmup``; ``oom`` when the
    device ran out of memory."""
    record = {"seq": seq, "offload": mode, "checkpointing": args.checkpointing}
    try:
        record.update(_step_case(args, seq, mode, device, repeats or args.repeats))
    except torch.OutOfMemoryError:
        record.update(oom=True)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def host_available_gib() -> float | None:
    """The host memory the kernel says is available now (``MemAvailable``, Linux), in GiB; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def host_shortfall(records: list[dict], seq: int, mode: str) -> str | None:
    """Why an offload case at ``seq`` would not fit in the host's memory, or None: its pinned bytes scaled
    linearly from the longest case of ``mode`` that ran (they grow with the tokens), against 90% of what is
    available. At 128k tokens the 1B config under selective checkpointing pinned 57.7 GiB (an H200, 2026-11-30): 2x
    that length needs about 115 GiB, more than a 128 GiB host holds beside the process; pinned memory that does not
    fit can take the whole host down with it."""
    ran = [r for r in records if r["offload"] == mode and not r["oom"] and r.get("host_gib")]
    available = host_available_gib() if mode != "none" and ran else None
    if available is None:
        return None
    last = max(ran, key=lambda r: r["seq"])
    needed = last["host_gib"] * seq / last["seq"]
    if needed <= 0.9 * available:
        return None
    return f"host memory: about {needed:.0f} GiB pinned, {available:.0f} GiB available"


def longest_without_offload(args: argparse.Namespace, device: torch.device) -> int:
    """The longest ``--start * 2**k`` a step without offload runs at (one step each, no repeats)."""
    seq, fits = args.start, 0
    while seq <= args.max_seq and not measure(args, seq, "none", device, repeats=1)["oom"]:
        fits, seq = seq, 2 * seq
    if not fits:
        raise SystemExit(f"no step without offload fits from --start {args.start}: lower it")
    return fits


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--checkpointing", default="selective", choices=["none", "selective", "full"])
    parser.add_argument("--offload", default="checkpointed", choices=["checkpointed", "all"])
    parser.add_argument("--seq", type=int, help="the length S (default: the longest that fits without offload)")
    parser.add_argument("--start", type=int, default=32768, help="the search's first length")
    parser.add_argument("--max-seq", type=int, default=2**21, help="the search's last length")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU, or pass --device cpu --tiny for a smoke run")
    if args.offload == "checkpointed" and args.checkpointing == "none":
        parser.error("--offload checkpointed needs --checkpointing selective or full (or --offload all)")
    if args.tiny:
        args.seq, args.warmup, args.repeats = args.seq or 64, 1, 1
    seq = args.seq or longest_without_offload(args, device)
    records: list[dict] = []
    for length in (seq, 2 * seq):
        for mode in ("none", args.offload):
            short = host_shortfall(records, length, mode)
            records.append(progress(measure(args, length, mode, device) if short is None else
                                    {"seq": length, "offload": mode, "checkpointing": args.checkpointing,
                                     "oom": True, "skipped": short}))
    baseline = {r["seq"]: r for r in records if r["offload"] == "none" and not r["oom"]}
    for record in records:
        same = baseline.get(record["seq"])
        record["vs_none"] = record["ms"] / same["ms"] if same and not record["oom"] else None
    num = lambda digits: (lambda x: "" if x is None or (isinstance(x, float) and math.isnan(x)) else  # noqa: E731
                          f"{x:.{digits}f}")
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("seq", "seq", text), ("offload", "offload", text), ("checkpointing", "checkpointing", text),
                   ("oom", "OOM", text), ("peak_gib", "peak GiB", num(1)),
                   ("reserved_gib", "reserved GiB", num(1)), ("alloc_retries", "alloc retries", text),
                   ("ms", "step ms", num(1)),
                   ("tokens_per_s", "tokens/s", num(0)), ("vs_none", "vs none", num(3)),
                   ("host_gib", "host GiB", num(2)), ("fetched_late", "fetched late", text),
                   ("skipped", "not run", text)])
    return records


if __name__ == "__main__":
    main()
