"""glibc keeps freed memory on CPU runs (cp_train/memory/cpu_memory.py): steps stop faulting their pages in again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cp_train.memory.cpu_memory import keep_freed_memory, on_glibc, startup_environment, user_chose_allocator

ROOT = Path(__file__).resolve().parents[2]

STEPS = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from cp_train.memory.cpu_memory import keep_freed_memory
applied = keep_freed_memory({{}}) if {apply} else False
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
weight = torch.randn(1024, 1024)
per_round = []
for _ in range(6):  # a step's pattern: activations of a few sizes (1-16 MiB), all freed at the end
    before = faults()
    for rows in (256, 2048, 4096):
        x = torch.randn(rows, 1024)
        y = torch.relu(x @ weight) + x
        del x, y
    per_round.append(faults() - before)
print(applied, sum(per_round[3:]))
"""


def _later_faults(apply: bool) -> tuple[bool, int]:
    """(whether the setting was applied, page faults of rounds 4-6) in a fresh interpreter, started without the
    allocator settings of this one's environment (``bench.common`` sets one on import)."""
    env = {key: value for key, value in os.environ.items() if user_chose_allocator({key: value}) is None}
    out = subprocess.run([sys.executable, "-c", STEPS.format(root=str(ROOT), apply=apply)], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not on_glibc(), reason="glibc only")
def test_repeated_steps_reuse_their_pages() -> None:
    applied, faults = _later_faults(apply=True)
    allocated_pages = 3 * 4 * (256 + 2048 + 4096) * 1024 * 4 // 4096  # rounds 4-6: four tensors per size
    assert applied and faults < allocated_pages / 8  # glibc's defaults: about 2 / 3 (0 or 2,048 of 76,800 here)


@pytest.mark.parametrize("environ", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                                     {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_the_users_allocator_settings_win(environ: dict[str, str]) -> None:
    assert user_chose_allocator(environ) == next(iter(environ))
    assert keep_freed_memory(environ) is False  # and nothing was changed


def test_other_variables_are_not_allocator_choices() -> None:
    assert user_chose_allocator({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1",
                                 "LD_PRELOAD": "/usr/lib/libfoo.so", "MALLOC": "x"}) is None


def test_the_environment_glibc_read_is_the_one_the_process_started_with(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_TOP_PAD_", "1")  # set now: for processes spawned later, not for this one's glibc
    started = startup_environment()
    assert "MALLOC_TOP_PAD_" not in started and "PATH" in started
