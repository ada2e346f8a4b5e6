"""Building a GPT dataset's indices (``data/sample_index.py``): time and peak memory, by chunks against at once.

    python -m bench.sample_index --documents 2000000 --samples 20000000 --seq-len 1024

``at_once`` is how the indices were built before 2026-11-30: int64 throughout, every document's token end and
start and every sample's first token held at once, the sample blocks' shuffles concatenated. ``chunks`` is
``build_indices`` (int32 where the values fit, the sample index found a chunk of documents at a time, the shuffles
written in place). Documents of lognormal lengths (median 665 tokens); each case in a fresh process (its own RSS
high-water mark, ``peak MB`` above the start); the two give the same indices (digests compared).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import time

import numpy as np

from bench.common import emit, median, peak_memory_mb, reset_peak_memory
from cp_train.data.sample_index import (
    INDEX_NAMES,
    SampleIndices,
    _generator,
    build_indices,
    epochs_needed,
    samples_per_block,
)


def indices_at_once(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int,
                    seed: int) -> SampleIndices:
    """The indices as they were built before (the baseline): every array int64, built whole."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    block = samples_per_block(tokens_per_epoch, seq_len)
    blocks = -(-num_samples // block)
    indexed = blocks * block
    epochs = epochs_needed(tokens_per_epoch, seq_len, indexed)
    document_index = np.concatenate([documents[_generator(seed, 0, e).permutation(len(documents))]
                                     for e in range(epochs)]).astype(np.int64)
    ends = np.cumsum(sizes[document_index].astype(np.int64))
    starts = np.concatenate([[0], ends[:-1]])
    first = np.arange(indexed + 1, dtype=np.int64) * seq_len
    position = np.searchsorted(ends, first, side="right")
    sample_index = np.stack([position, first - starts[position]], axis=1)
    shuffle = np.concatenate([b * block + _generator(seed, 1, b).permutation(block) for b in range(blocks)])
    return SampleIndices(document_index, sample_index.astype(np.int64), shuffle[:num_samples].astype(np.int64))


def run_case(method: str, documents: int, samples: int, seq_len: int) -> tuple[float, float, float, str]:
    """``(seconds, peak MB above the start, bytes of the indices, their digest)``."""
    sizes = (np.random.default_rng(0).lognormal(6.5, 1.0, documents) + 1).astype(np.int32)
    ids = np.arange(documents)
    start = reset_peak_memory()
    began = time.perf_counter()
    build = indices_at_once if method == "at_once" else build_indices
    indices = build(sizes, ids, seq_len, samples, 1234)
    seconds, peak = time.perf_counter() - began, peak_memory_mb() - start
    digest = hashlib.sha256()
    for name in INDEX_NAMES:
        digest.update(np.ascontiguousarray(getattr(indices, name), dtype=np.int64).tobytes())
    stored = sum(getattr(indices, name).nbytes for name in INDEX_NAMES)
    return seconds, peak, stored, digest.hexdigest()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=2_000_000)
    parser.add_argument("--samples", type=int, default=20_000_000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    records, digests, spawn = [], set(), multiprocessing.get_context("spawn")
    for method in ("at_once", "chunks"):
        runs = []
        for _ in range(args.rounds):
            with spawn.Pool(1) as pool:
                seconds, peak, stored, digest = pool.apply(run_case, (method, args.documents, args.samples,
                                                                       args.seq_len))
            digests.add(digest)
            runs.append((seconds, peak))
        records.append({"bench": "sample_index", "method": method, "documents": args.documents,
                        "samples": args.samples, "seq_len": args.seq_len, "seconds": median([s for s, _ in runs]),
                        "peak_mb": median([p for _, p in runs]), "stored_mb": stored / 2**20})
    assert len(digests) == 1, "the two builds give different indices"
    for record in records:
        record["time_vs_at_once"] = record["seconds"] / records[0]["seconds"]
        record["peak_vs_at_once"] = record["peak_mb"] / records[0]["peak_mb"]
    emit(records, [("method", "method", str), ("seconds", "s", "{:.2f}".format),
                   ("time_vs_at_once", "vs at once", "{:.2f}".format), ("peak_mb", "peak MB", "{:.0f}".format),
                   ("peak_vs_at_once", "vs at once", "{:.2f}".format), ("stored_mb", "indices MB", "{:.0f}".format)])
    return records


if __name__ == "__main__":
    main()
