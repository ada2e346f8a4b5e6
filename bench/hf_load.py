"""Time and peak memory of ``load_llama`` on a 1B-shaped random Hugging Face Llama, at tp = 1 and tp = 2.

    python -m bench.hf_load [--dir /tmp/cp-train-llama-1b] [--tps 1 2] [--dtype float32] [--repeats 2]

Writes (once; reused when present) a random bf16 checkpoint shaped like Llama 3.2 1B (vocab 128256,
hidden 2048, 16 layers, 32 heads, 8 kv heads, ffn 8192, tied embeddings: 1.24 B parameters, one
2.5 GB model.safetensors), then loads it in freshly spawned gloo ranks (world = tp). Each rank
resets its RSS high-water mark, loads, and reports the seconds and the peak RSS added by the load
against the bytes of the parameters it holds (its TP shard): a rank that read more than its shard,
or built the full model first, would show a ratio well above 1. The figure per tp is the median
over repeats of the slowest / largest rank. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import emit, median, peak_memory_mb, reset_peak_memory  # sets the env the ranks start with
from cp_train.model.config import ModelConfig
from cp_train.model.hf.config import hf_config
from cp_train.model.hf.llama import load_llama
from cp_train.model.hf.weights import hf_tensors, write_weights
from cp_train.parallel.mesh.model_parallel import ModelParallel
from cp_train.parallel.spawn import SpawnedWorld

LLAMA_1B = {"vocab_size": 128256, "num_layers": 16, "hidden_size": 2048, "num_heads": 32, "num_kv_heads": 8,
            "ffn_hidden_size": 8192, "max_position_embeddings": 131072, "rope_theta": 500000.0, "norm_eps": 1e-5,
            "tie_embeddings": True, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_random_checkpoint(path: Path, config: ModelConfig) -> None:
    """A random bf16 HF checkpoint of ``config`` (one tensor in memory at a time)."""
    entries = {entry.name: entry for entry in hf_tensors(config)}

    def produce(names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for index, name in enumerate(names):
            generator = torch.Generator().manual_seed(index)
            shape = entries[name].shape
            tensor = torch.ones(shape) if len(shape) == 1 else torch.empty(shape).normal_(0, 0.02, generator=generator)
            yield name, tensor.to(torch.bfloat16)

    path.mkdir(parents=True, exist_ok=True)
    sizes = [(e.name, 2 * int(torch.Size(e.shape).numel())) for e in entries.values()]
    write_weights(path, sizes, produce, max_shard_bytes=1 << 40, write=True)
    (path / "config.json").write_text(json.dumps(hf_config(config, "bfloat16"), indent=2) + "\n")


def load_on_rank(path: str, dtype_name: str, repeats: int) -> dict:
    """On every rank of a world that is the TP group: seconds, peak added MB and shard MB of each load."""
    seconds, added = [], []
    shard_mb = 0.0
    for _ in range(repeats):
        dist.barrier()
        base = reset_peak_memory()
        start = time.perf_counter()
        model = load_llama(path, ModelParallel.build(tp_group=dist.group.WORLD), dtype=DTYPES[dtype_name])
        seconds.append(time.perf_counter() - start)
        added.append(peak_memory_mb() - base)
        shard_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        del model
    return {"seconds": seconds, "added_mb": added, "shard_mb": shard_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/cp-train-llama-1b", help="checkpoint directory (written if missing)")
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype after loading")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="total threads, shared by the ranks")
    args = parser.parse_args()
    config = ModelConfig(**LLAMA_1B)
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        start = time.perf_counter()
        write_random_checkpoint(path, config)
        print(f"wrote {path} in {time.perf_counter() - start:.1f} s", flush=True)
    file_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
    records = []
    for tp in args.tps:
        with SpawnedWorld(tp, threads=max(1, args.threads // tp), timeout_s=3600) as world:
            per_rank = world.run(load_on_rank, str(path), args.dtype, args.repeats)
        seconds = median([max(r["seconds"][i] for r in per_rank) for i in range(args.repeats)])
        added = median([max(r["added_mb"][i] for r in per_rank) for i in range(args.repeats)])
        shard = max(r["shard_mb"] for r in per_rank)
        records.append({"tp": tp, "dtype": args.dtype, "file_mb": file_mb, "parameters": sum(
            int(torch.Size(e.shape).numel()) for e in hf_tensors(config)), "seconds": seconds,
            "shard_mb_per_rank": shard, "peak_added_mb_per_rank": added, "peak_over_shard": added / shard})
    base = records[0]
    for record in records:
        record["seconds_vs_first"] = record["seconds"] / base["seconds"]
        record["peak_vs_first"] = record["peak_added_mb_per_rank"] / base["peak_added_mb_per_rank"]
    num = lambda digits: (lambda x: f"{x:.{digits}f}")  # noqa: E731
    emit(records, [("tp", "tp", str), ("dtype", "dtype", str), ("seconds", "load s", num(1)),
                   ("shard_mb_per_rank", "shard MB/rank", num(0)), ("peak_added_mb_per_rank", "peak MB/rank", num(0)),
                   ("peak_over_shard", "peak/shard", num(3)), ("seconds_vs_first", "time vs tp1", num(3)),
                   ("peak_vs_first", "peak vs tp1", num(3))])


if __name__ == "__main__":
    main()
