"""The dry run's activation estimate (``cp_train/memory/activations.py``) against the measured peak of one block.

    python -m bench.activations [--seq 8192] [--cases 1,1 1,4 2,1 2,4 4,4]

Each case ``cp,mlp_chunks`` runs one GPT block's forward + backward in fp32 on freshly spawned CPU ranks
(``bench.memory.measure_block``: the peak RSS added by the step, the largest rank, median of repeats)
and prints it beside ``activations.block_peak`` for the same shapes, with estimate / measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/activations.py` from anywhere

from bench.common import emit, median  # noqa: E402  (sets the env the ranks start with)
from bench.memory import measure_block  # noqa: E402
from cp_train.memory.activations import block_peak, shapes_of  # noqa: E402
from cp_train.model.config import ModelConfig  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402

BLOCK = {"vocab_size": 256, "num_layers": 1, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 1024}  # bench/memory.py's block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192, help="total sequence length (all CP ranks)")
    parser.add_argument("--cases", nargs="+", default=["1,1", "1,4", "2,1", "2,4", "4,4"], help="cp,mlp_chunks")
    parser.add_argument("--threads", type=int, default=2, help="total threads, shared by the ranks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    records = []
    for case in args.cases:
        cp, chunks = (int(x) for x in case.split(","))
        config = ModelConfig(**BLOCK, max_position_embeddings=args.seq, mlp_chunks=chunks)
        with SpawnedWorld(cp, threads=max(1, args.threads // cp), timeout_s=3600) as world:
            per_rank = world.run(measure_block, config, "zigzag", args.seq, 1, args.repeats)
        measured = median([max(r["added_mb"][i] for r in per_rank) for i in range(args.repeats)])
        estimate = block_peak(shapes_of(config, args.seq // cp, 1, cp, 4, 4), chunks) / 2**20
        records.append({"cp": cp, "mlp_chunks": chunks, "seq": args.seq, "tokens_per_rank": args.seq // cp,
                        "measured_mb": measured, "estimated_mb": estimate,
                        "estimate_over_measured": estimate / measured})
    num = lambda digits: (lambda x: "" if x is None else f"{x:.{digits}f}")  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("cp", "cp", text), ("mlp_chunks", "mlp_chunks", text), ("tokens_per_rank", "tokens/rank", text),
                   ("measured_mb", "measured MB/rank", num(1)), ("estimated_mb", "estimated MB", num(1)),
                   ("estimate_over_measured", "estimate/measured", num(3))])


if __name__ == "__main__":
    main()
