"""Export a training checkpoint (DCP, any tp/cp/dp layout) as a Hugging Face model directory (the architecture the
model came from; granite_swa with sinks)::

    cp-train-export-hf CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--tokenizer-from HF_DIR]

(also ``python -m cp_train.cli.export_hf``). The export itself is ``cp_train.checkpoint.export_hf``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cp_train.checkpoint.export_hf import DTYPES, TOKENIZER_FILES, export_checkpoint
from cp_train.config.arg_types import OneLineParser, positive_float
from cp_train.errors import exit_now, run_entry_point
from cp_train.model.hf.llama import DEFAULT_SHARD_BYTES


def run(argv: Sequence[str] | None = None) -> Path:
    """The command line (``cp-train-export-hf --help``); returns the output directory."""
    parser = OneLineParser(prog="cp-train-export-hf", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint directory (its `latest`) or one step_* directory")
    parser.add_argument("out", help="output directory (config.json, safetensors, tokenizer files)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="stored dtype (default: as saved)")
    parser.add_argument("--tokenizer-from", default=None,
                        help="HF directory whose tokenizer files and token ids to copy (default: the run's "
                             "checkpoint.init_from_hf)")
    parser.add_argument("--max-shard-gb", type=positive_float, default=DEFAULT_SHARD_BYTES / 2**30,
                        help="largest safetensors file before sharding (default 5)")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out, DTYPES.get(args.dtype), args.tokenizer_from,
                            int(args.max_shard_gb * 2**30))
    print(f"exported {args.checkpoint} to {out}")
    if not any((out / name).is_file() for name in TOKENIZER_FILES):
        print(f"no tokenizer files in {out}: the run's tokenizer is not a Hugging Face one; copy them with "
              f"--tokenizer-from HF_DIR (tokenizer.json and its config) for transformers' AutoTokenizer")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: one line and an exit code on failure."""
    return run_entry_point("cp-train-export-hf", lambda args: run(args) and None, argv)


def console_main() -> NoReturn:
    """The ``cp-train-export-hf`` console script: ``main``, then the end of the process (``exit_now``: without the
    interpreter's teardown of the modules)."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
