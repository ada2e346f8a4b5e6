"""Making a blend's schedule (``data/blended.py``): time and peak memory, window by window against one sort.

    python -m bench.blend --samples 20000000 --datasets 2 50 1000

``one_sort`` is the schedule's definition and how it was made before 2026-11-30: every dataset's candidate samples
(a few more than its share) with their ideal times, one ``lexsort`` on (time, dataset), the first ``samples`` kept.
``windows`` is ``blend_schedule`` (windows of ideal time sorted apart, into int64 arrays); ``windows_to_files``
is ``cached_blend_schedule``, the trainer's path (into its compact files, memory-mapped). Each case checks it gives
``one_sort``'s schedule. Each case runs in a fresh process; ``peak MB``: its RSS high-water mark above the start
(the files' mapped pages count).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.common import emit, median, peak_memory_mb, reset_peak_memory
from cp_train.data.blended import blend_schedule, cached_blend_schedule


def one_sort_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The blend's schedule by one sort of every candidate sample on (ideal time, dataset): (dataset ids, sample
    ids), int64."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    candidates = [(np.arange(int(rate * num_samples) + len(weights) + 2), d, rate) for d, rate in enumerate(share)
                  if rate > 0]
    times = np.concatenate([(k + 0.5) / rate for k, _, rate in candidates])
    ids = np.concatenate([np.full(len(k), d) for k, d, _ in candidates])
    order = np.lexsort((ids, times))[:num_samples]
    return ids[order], np.concatenate([k for k, _, _ in candidates])[order]


def run_case(method: str, weights: Sequence[float], samples: int, folder: str) -> tuple[float, float, str]:
    """``(seconds, peak MB above the start, the schedule's digest)`` of one way of making the schedule."""
    start = reset_peak_memory()
    began = time.perf_counter()
    if method == "one_sort":
        schedule = one_sort_schedule(weights, samples)
    elif method == "windows":
        schedule = blend_schedule(weights, samples)
    else:
        schedule = cached_blend_schedule(weights, samples, Path(tempfile.mkdtemp(dir=folder)), "train")
    seconds, peak = time.perf_counter() - began, peak_memory_mb() - start
    digest = hashlib.sha256()
    for array in schedule:
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return seconds, peak, digest.hexdigest()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000_000)
    parser.add_argument("--datasets", type=int, nargs="+", default=[2, 50, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    records, spawn = [], multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        for count in args.datasets:
            weights = tuple(np.random.default_rng(count).random(count) + 0.01)
            digests = set()
            for method in ("one_sort", "windows", "windows_to_files"):
                runs = []
                for _ in range(args.rounds):
                    with spawn.Pool(1) as pool:  # a fresh process: its own high-water mark, no freed heap to reuse
                        seconds, peak, digest = pool.apply(run_case, (method, weights, args.samples, folder))
                    digests.add(digest)
                    runs.append((seconds, peak))
                records.append({"bench": "blend", "datasets": count, "samples": args.samples, "method": method,
                                "seconds": median([s for s, _ in runs]), "peak_mb": median([p for _, p in runs])})
            assert len(digests) == 1, f"{count} datasets: the methods' schedules differ"
            base = next(r for r in records if r["datasets"] == count and r["method"] == "one_sort")
            for record in records[-3:]:
                record["time_vs_one_sort"] = record["seconds"] / base["seconds"]
                record["bytes_per_sample"] = record["peak_mb"] * 2**20 / args.samples
    emit(records, [("datasets", "datasets", str), ("method", "method", str), ("seconds", "s", "{:.2f}".format),
                   ("time_vs_one_sort", "vs one sort", "{:.2f}".format), ("peak_mb", "peak MB", "{:.0f}".format),
                   ("bytes_per_sample", "B/sample", "{:.1f}".format)])
    return records


if __name__ == "__main__":
    main()
