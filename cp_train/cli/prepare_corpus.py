"""Build the embedded default corpus (the installed Python standard library, tokenized) ahead of a run::

    python -m cp_train.cli.prepare_corpus [--cache-dir DIR] [--workers N]

(a run builds it on first use anyway; ``cp_train.data.default_corpus``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from cp_train.data.default_corpus import DefaultCorpus, prepare_default_corpus
from cp_train.errors import run_entry_point


def run(argv: Sequence[str] | None = None) -> DefaultCorpus:
    parser = argparse.ArgumentParser(prog="python -m cp_train.cli.prepare_corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None,
                        help="where to build (default $CP_TRAIN_CACHE or ~/.cache/cp-train)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores, <= 4)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    corpus = prepare_default_corpus(args.cache_dir, workers=args.workers, progress=True)
    manifest = json.loads((corpus.tokenizer_model.parent / "manifest.json").read_text())
    print(f"default corpus ({time.perf_counter() - start:.1f} s):\n"
          f"  tokenizer  {corpus.tokenizer_model} ({manifest['vocab_size']} ids)\n"
          f"  data       {corpus.data_prefix}.bin/.idx ({manifest['documents']} documents, "
          f"{manifest['tokens']:,} tokens)\n"
          f"  sources    {manifest['files']} files of {manifest['source_root']}")
    return corpus


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point("python -m cp_train.cli.prepare_corpus", lambda args: run(args) and None, argv)


if __name__ == "__main__":
    sys.exit(main())
