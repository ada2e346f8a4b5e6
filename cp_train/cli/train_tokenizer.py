"""Train a SentencePiece tokenizer on text files::

    python -m cp_train.cli.train_tokenizer --input corpus.txt more.txt --vocab-size 8000 --output-prefix tok

writes ``tok.model`` (byte-exact BPE: ``cp_train.data.tokenizers.spm.train_tokenizer``), which
``--tokenizer-model`` (``data.tokenizer``) and ``cp-train-preprocess --tokenizer`` take.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cp_train.errors import InputError, run_entry_point

PROG = "python -m cp_train.cli.train_tokenizer"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text files (one sentence or line each)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="ids, 260 or more (default 8000)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model")
    parser.add_argument("--threads", type=int, default=4, help="sentencepiece threads (default 4)")
    args = parser.parse_args(argv)
    from cp_train.data.tokenizers.spm import train_tokenizer

    missing = [path for path in args.input if not Path(path).is_file()]
    if missing:
        raise InputError(f"--input {missing[0]} is not a file: pass text files")
    try:
        model = train_tokenizer(args.input, args.vocab_size, args.output_prefix, num_threads=args.threads)
    except (ValueError, RuntimeError) as error:
        raise InputError(f"training the tokenizer failed: {error}") from None
    print(model)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main())
