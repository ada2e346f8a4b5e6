"""Shared fixtures: one persistent spawned gloo world per world size, per test session."""

from __future__ import annotations

import compileall
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cp_train.parallel.spawn import SpawnedWorld

ROOT = Path(__file__).resolve().parents[1]
STRICT = "tests.strict_comm"  # every spawned world runs under it
# imported once; the ranks fork with them loaded. torch._dynamo: every torch optimizer's first construction imports
# it (about 2 s per rank of each new world on 2 cores); Inductor: each compiling rank's first compile imports it
PRELOAD = (STRICT, "cp_train.trainer", "tests.trainer_cases", "torch._dynamo", "torch._inductor.compile_fx")
# Inductor compiles in the process that asks (the same code): its default pool of compile workers, each a new
# interpreter importing torch, costs each rank that compiles more than it saves on 2 cores
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU kernels without SIMD: g++ builds the scalar C++ about a fifth faster, which is most of what a
# compiled test costs where Inductor's caches are empty (a fresh machine; the suite then took 1,118 s, not 854 s).
# The GPU's kernels are Triton's, so nothing the CPU suite checks depends on the CPU kernels' vector code
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
_MAX_ALIVE = 5  # worlds kept alive at once: every size the suite uses (1, 2, 3, 4, 8; a rank holds 0.35-0.45 GB)


@pytest.fixture(scope="session")
def spawn_world() -> Iterator[Callable[[int], SpawnedWorld]]:
    """``spawn_world(n)`` returns a live gloo world of n ranks, reused across tests, under the strict
    communication layer (``tests/strict_comm.py``: NCCL's pairing of messages, every job's collectives checked).

    A world that broke (a rank raised mid-collective) is replaced on the next request.
    """
    worlds: dict[int, SpawnedWorld] = {}

    def get(n: int) -> SpawnedWorld:
        world = worlds.get(n)
        if world is not None and not world.broken:
            worlds[n] = worlds.pop(n)  # most recently used last
            return world
        if world is not None:
            world.close()
            del worlds[n]
        while len(worlds) >= _MAX_ALIVE:
            oldest = next(iter(worlds))
            worlds.pop(oldest).close()
        worlds[n] = SpawnedWorld(n, layer=STRICT, preload=PRELOAD)
        return worlds[n]

    yield get
    for world in worlds.values():
        world.stop()
    for world in worlds.values():
        world.close()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the project once, as its first import does where ``PYTHONDONTWRITEBYTECODE`` is unset: the
    fresh interpreters the tests start (launchers, torchrun ranks, command-line calls) then load cached
    bytecode, not compile about 0.35 s of the project's source each, where the variable is set (this machine)."""
    for folder in ("cp_train", "model", "parallel", "data", "tests"):
        compileall.compile_dir(ROOT / folder, quiet=1)
