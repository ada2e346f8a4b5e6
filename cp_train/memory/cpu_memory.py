"""CPU runs: glibc's allocator keeps freed memory in the process instead of handing it back every step.

With glibc's defaults, a tensor above malloc's (dynamic) mmap threshold is mapped fresh when it is
allocated and unmapped when it is freed, and a heap top above the trim threshold is returned to the
kernel, so every micro-batch faults its activations (and FSDP2 its gathered parameters and gradient
buffers) back in page by page: at the cpu-tiny shape (``bench/fsdp.py``) 8,000 faults per rank and
step under DDP, 13,000 under FSDP2, 20-50 ms of system time. ``keep_freed_memory`` fixes the mmap
threshold at 32 MiB and turns trimming off, so a step reuses the pages of the last one (about 0 faults
per step; 3-5% off the step, more with FSDP2) and the process's resident memory stays near its peak
instead of following live tensors.

A user's own choice wins: nothing changes when the environment sets a glibc malloc tunable
(``MALLOC_*_``, ``GLIBC_TUNABLES``: ``bench/memory.py`` does, so that RSS follows live memory) or
preloads another allocator (jemalloc, tcmalloc, mimalloc); nor on a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit; larger blocks are
# still mapped and unmapped each time (their faults are small beside the work on them)


def on_glibc() -> bool:
    """Whether this process runs on Linux with glibc (where ``mallopt`` and its parameters apply)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def user_chose_allocator(environ: Mapping[str, str]) -> str | None:
    """The environment variable through which the user configured the allocator, or None."""
    for key, value in environ.items():
        if key.startswith("MALLOC_") and key.endswith("_"):
            return key
        if key == "GLIBC_TUNABLES" and "malloc" in value:
            return key
        if key == "LD_PRELOAD" and any(name in value for name in ("jemalloc", "tcmalloc", "mimalloc")):
            return key
    return None


def startup_environment() -> Mapping[str, str]:
    """The environment this process started with, which is what glibc read its tunables from (``os.environ``
    may have changed since: a module that sets a variable for the processes it will spawn)."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return os.environ
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Fix glibc's mmap threshold and turn trimming off for this process (``mallopt``); whether it was set.
    ``environ``: the variables glibc was started with (default: this process's, ``startup_environment``).

    Process-wide and lasting: call it once, on CPU runs, before the first step."""
    environ = startup_environment() if environ is None else environ
    if not on_glibc() or user_chose_allocator(environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, -1) == 1
