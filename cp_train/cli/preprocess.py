"""Tokenize text into a Megatron ``.bin``/``.idx`` pair::

    cp-train-preprocess --input PATH... --tokenizer MODEL --output-prefix PREFIX [--workers N] [--json-key text]

(also ``python -m cp_train.cli.preprocess``). What is read and written: ``cp_train.data.preprocess``. A bad
input ends with one line naming the file (and line) and exit code 2; nothing half-written is left.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cp_train.data.indexed import data_path
from cp_train.data.preprocess import (
    JSON_SUFFIXES,
    PreprocessError,
    PreprocessSummary,
    iter_documents,
    list_input_files,
    preprocess,
)
from cp_train.errors import DEBUG_ENV, DEBUG_FLAG, InputError, exit_now, run_entry_point


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cp-train-preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="text files, .jsonl files or directories")
    parser.add_argument("--tokenizer", required=True,
                        help="SentencePiece .model file, or a HF tokenizer.json or a directory holding one")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument("--json-key", default="text", help="field holding the text in .jsonl")
    parser.add_argument("--glob", default="*", help="file pattern inside directories (default *)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=f"print tracebacks of errors (also {DEBUG_ENV}=1)")
    return parser.parse_args(argv)


def warn(text: str) -> None:
    print(f"cp-train-preprocess: warning: {text}", file=sys.stderr, flush=True)


def run(argv: Sequence[str] | None = None) -> PreprocessSummary:
    """Preprocess as the command line ``argv`` says; raises ``InputError`` or ``PreprocessError`` for a bad
    input."""
    args = parse_args(argv)
    if args.output_prefix.endswith(("/", os.sep)) or Path(args.output_prefix).is_dir():
        raise InputError(f"--output-prefix {args.output_prefix} names a directory: add the files' name, e.g. "
                         f"{Path(args.output_prefix) / 'data'} (writes data.bin and data.idx there)")
    files = list_input_files(args.input, args.glob)
    if not files:
        raise InputError(f"no input files found in {' '.join(args.input)} (glob {args.glob!r}): "
                         f"pass files or directories that hold some")
    for path in files:
        if path.stat().st_size == 0:
            warn(f"{path} is empty: it adds no document")
    has_json = any(p.suffix in JSON_SUFFIXES for p in files)
    summary = preprocess(iter_documents(files, args.json_key), args.tokenizer, args.output_prefix,
                         workers=args.workers, progress=not args.quiet,
                         total=None if has_json else len(files))
    if summary.documents == 0:
        warn(f"the inputs hold no document: {data_path(args.output_prefix)} is an empty dataset")
    print(summary)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: one line and exit code 2 for a bad input (see the module docstring)."""
    def command(args: list[str]) -> int:
        try:
            run(args)
        except PreprocessError as error:  # the library's bad-input error: one line, exit code 2
            raise InputError(str(error)) from None
        return 0

    return run_entry_point("cp-train-preprocess", command, argv)


def console_main() -> NoReturn:
    """The ``cp-train-preprocess`` console script: ``main``, then the end of the process (``exit_now``: without the
    interpreter's teardown of the modules)."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
