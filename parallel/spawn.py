"""A persistent world of spawned CPU ranks on gloo, for tests and benchmarks.

Starting a gloo process group costs seconds, so a ``SpawnedWorld`` starts its
ranks once and then runs any number of functions on all of them:

    with SpawnedWorld(4) as world:
        results = world.run(my_module.check_something, 1024, causal=True)

``fn`` must be importable by the children (a module-level function) and is
called as ``fn(*args, **kwargs)`` on every rank after ``torch.distributed`` is
initialised (rank and size come from ``torch.distributed``). ``run`` returns
the per-rank return values in rank order, or raises ``RankError`` carrying the
first failing rank's traceback.

``layer`` names a module that every rank loads after ``init_process_group``: its ``install()`` runs once, its
``after_job()`` after each job (what it returns travels to the parent), and the parent's ``check(payloads)``
gets them in rank order and returns None or one line, which fails the job (the test suite's strict
communication layer, ``tests/strict_comm.py``).

``preload`` names modules to import once in a fork server (Linux): the ranks then fork from it instead of starting
a fresh interpreter (a world of 8 starts in 0.8 s instead of 9 s, torch and the named modules already
imported). The first world that asks starts the server; its list holds for the rest of the process. Each rank
still gets the parent's environment as it was when its world started, as a spawned rank would.
"""

from __future__ import annotations

import gc
import importlib
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A function failed on at least one spawned rank."""


def free_port() -> int:
    """Return a TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, threads: int, timeout_s: float,
               env: dict[str, str], layer: str | None, jobs: Any, results: Any) -> None:
    os.environ.clear()  # a forked rank holds the fork server's environment: take the parent's, as spawn would
    os.environ.update(env)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    hooks = importlib.import_module(layer) if layer else None
    if hooks is not None:
        hooks.install()
    gc.collect()
    gc.freeze()  # the imports are never scanned again: a job's full collection scans what the jobs made
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            fn, args, kwargs = job
            try:
                value, ok = fn(*args, **kwargs), True
            except BaseException:  # noqa: BLE001 - the traceback travels to the parent
                value, ok = traceback.format_exc(), False
            payload = hooks.after_job() if hooks is not None else None
            results.put((rank, ok, value, payload))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every answer was taken: skip the interpreter's teardown of a large heap (seconds for a world)


def _context(preload: Sequence[str]) -> Any:
    """spawn, or with ``preload`` on Linux a fork server that imported those modules (and torch) once (elsewhere
    spawn: macOS frameworks are not safe to fork after their first use, and Windows has no fork)."""
    if not preload or sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, *preload])
    return ctx


def _secondary(tb: str) -> bool:
    """Whether a rank's traceback is a consequence of another rank's failure (a timeout, a lost peer)."""
    last = tb.strip().splitlines()[-1].lower() if tb.strip() else ""
    return any(marker in last for marker in ("timed out", "timeout", "connection closed", "connection reset",
                                             "another rank failed"))


class SpawnedWorld:
    """``world`` gloo ranks on this machine, alive until ``close()``.

    ``threads`` is torch's intra-op thread count per rank (default: the
    machine's cores shared evenly, at least 1). ``timeout_s`` bounds every
    collective and every ``run``.
    """

    def __init__(self, world: int, threads: int | None = None, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, layer: str | None = None, preload: Sequence[str] = ()) -> None:
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        self.world = world
        self.layer = importlib.import_module(layer) if layer else None
        self.payloads: list[Any] = [None] * world
        self.timeout_s = timeout_s
        self.threads = threads or max(1, (os.cpu_count() or 1) // world)
        ctx = _context(preload)
        self._jobs = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_rank_main, daemon=True,
                        args=(r, world, port, self.threads, timeout_s, {**os.environ, **(env or {})}, layer,
                              self._jobs[r], self._results))
            for r in range(world)
        ]
        for proc in self._procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self.broken:
            raise RankError("this world broke in an earlier run; start a new one")
        for jobs in self._jobs:
            jobs.put((fn, args, kwargs))
        out: list[Any] = [None] * self.world
        payloads: list[Any] = [None] * self.world
        failures: list[tuple[int, str]] = []
        deadline = time.monotonic() + self.timeout_s + 30
        for _ in range(self.world):
            rank, ok, value, payloads[rank] = self._next_result(fn.__name__, deadline)
            if ok:
                out[rank] = value
            else:
                failures.append((rank, value))
        if failures:  # a rank's own error before the peers' timeouts and lost connections it caused
            rank, tb = min(failures, key=lambda failure: (_secondary(failure[1]), failure[0]))
            raise RankError(f"{fn.__name__} failed on rank {rank}:\n{tb}")
        self.payloads = payloads  # the layer's record of this job, per rank
        found = self.layer.check(payloads) if self.layer is not None else None
        if found is not None:
            raise RankError(f"{fn.__name__}: {found}")
        return out

    def _next_result(self, name: str, deadline: float) -> tuple[int, bool, Any, Any]:
        """The next rank's answer; raises at once when a rank died, or at the deadline."""
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    why = f"ranks {dead} died" if dead else f"no answer within {self.timeout_s + 30:.0f} s"
                    raise RankError(f"{name}: {why}") from None

    def stop(self) -> None:
        """Ask every rank to stop without waiting (``close`` waits): several worlds stop side by side."""
        for jobs in self._jobs:
            try:
                jobs.put(None)
            except (ValueError, OSError):
                pass

    def close(self) -> None:
        """Stop every rank and wait for it (idempotent)."""
        self.stop()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._procs = []

    def __enter__(self) -> SpawnedWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
