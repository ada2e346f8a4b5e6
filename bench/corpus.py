"""Time the default-corpus build from scratch (the issue's budget: under two minutes on 2 cores).

    python -m bench.corpus [--repeats 3] [--workers N]

Each repeat builds into a fresh temporary directory (never the real cache) and reports the
tokenizer-training, tokenizing and total seconds, and whether every repeat gave the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from cp_train.data.default_corpus import corpus_dir, prepare_default_corpus


def build_once(workers: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="cp-train-bench-") as cache:
        start = time.perf_counter()
        prepare_default_corpus(cache, workers=workers)
        total = time.perf_counter() - start
        manifest = json.loads((corpus_dir(Path(cache)) / "manifest.json").read_text())
    return {"total_s": round(total, 2), "tokenizer_s": manifest["tokenizer_seconds"],
            "preprocess_s": manifest["preprocess_seconds"], "tokens": manifest["tokens"],
            "documents": manifest["documents"], "sha256": manifest["sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    runs = [build_once(args.workers) for _ in range(args.repeats)]
    totals = [r["total_s"] for r in runs]
    print(json.dumps({
        "cores": os.cpu_count(), "repeats": args.repeats, "median_total_s": statistics.median(totals),
        "max_total_s": max(totals), "runs": [{k: v for k, v in r.items() if k != "sha256"} for r in runs],
        "deterministic": all(r["sha256"] == runs[0]["sha256"] for r in runs),
        "tokens_per_s": round(runs[0]["tokens"] / statistics.median(r["preprocess_s"] for r in runs)),
    }, indent=2))


if __name__ == "__main__":
    main()
