"""Helpers shared by the benchmarks: memory high-water marks, timing, output as JSON lines plus a table."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

# Run benchmarks as modules from the repository root: `python -m bench.attention ...`.
# Large allocations are mmapped and unmapped at once, so RSS follows live memory
# (glibc's adaptive threshold would otherwise keep freed buffers and hide peaks).
MMAP_THRESHOLD, LIVE_MEMORY_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", "65536"
os.environ.setdefault(MMAP_THRESHOLD, LIVE_MEMORY_THRESHOLD)  # inherited by the spawned ranks


@contextmanager
def glibc_malloc(live_memory: bool) -> Iterator[None]:
    """Processes started inside the block run with the 64 KiB mmap threshold (``live_memory``: RSS follows live
    memory, for peaks) or with glibc's defaults (freed buffers are reused, as in training: for timings)."""
    saved = os.environ.get(MMAP_THRESHOLD)
    if live_memory:
        os.environ[MMAP_THRESHOLD] = LIVE_MEMORY_THRESHOLD
    else:
        os.environ.pop(MMAP_THRESHOLD, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(MMAP_THRESHOLD, None)
        else:
            os.environ[MMAP_THRESHOLD] = saved


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak_memory() -> float:
    """Reset this process's RSS high-water mark; returns the current RSS in MB (the baseline)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_mb("VmRSS")


def peak_memory_mb() -> float:
    """The RSS high-water mark (MB) since the last ``reset_peak_memory``."""
    return _status_mb("VmHWM")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def progress(record: dict) -> dict:
    """Print ``record`` at once as ``DONE {json}`` (flushed), so a time-boxed run that is stopped keeps the cases it
    finished; returns it."""
    print("DONE " + json.dumps(record), flush=True)
    return record


def emit(records: list[dict], columns: Sequence[tuple[str, str, Callable[[object], str]]]) -> None:
    """Print one JSON line per record, then an aligned table of ``columns`` (key, header, formatter)."""
    for record in records:
        print(json.dumps(record), flush=True)
    rows = [[header for _, header, _ in columns]]
    rows += [[fmt(r.get(key)) for key, _, fmt in columns] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    print()
    for index, row in enumerate(rows):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def fp8_variant(name: str) -> tuple[str, str]:
    """An FP8 bench variant's ``(model.fp8, model.fp8_fast_accum)``: ``tensorwise-fast`` is tensorwise with every
    GEMM accumulating fast ("all"); a plain recipe (or none / bf16) keeps the recipes' own ("output")."""
    recipe = name.removesuffix("-fast")
    return recipe, "all" if recipe != name else "output"
