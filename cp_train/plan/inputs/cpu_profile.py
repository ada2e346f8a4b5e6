"""The CPU section of a hardware profile (``cpu:`` in the YAML, written by ``--calibrate``): how the ranks of one
machine share its cores, the host time per dispatched op, and gloo's collectives by world size.

A CPU profile describes one core: its matmul, attention and copy rates are measured on one thread. A layout of
``ranks`` processes on ``cores`` cores runs ``max(1, cores // ranks)`` torch threads per rank (the trainer's
spawned worlds, and torch's default at one rank; torchrun sets one thread per rank), so a rank's compute rate is
the one-thread rate times ``compute_scale(ranks)``: the measured thread speedup interpolated to its threads, times
``cores / ranks`` beyond the cores (the ranks take turns on them), times ``shared_efficiency`` with more than one
rank (ranks computing at once share the memory bandwidth and caches: measured). Host work (Python, the dispatcher,
autograd: ``op_overhead_us`` per op) runs on one thread and slows by ``ranks / cores`` beyond the cores. Gloo's
bandwidth and latencies, and the CP attention op's own cost per call (``attention_calls``: at a negligible size,
so everything but the arithmetic and the bytes), are measured at several world sizes (all ranks busy at once, as
in a training step) and interpolated linearly in the world size, the end values held beyond the measured ones.

Units: GB/s (1e9 B/s) per rank, microseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cp_train.errors import InputError

KEYS = {"cores": "CPU cores the ranks share (an integer >= 1)",
        "thread_speedup": "the model step's speedup on all the cores' threads over one thread (1 to cores)",
        "op_overhead_us": "host time per aten op of a training step, forward and backward, microseconds",
        "collectives": "gloo by world size: a list of [ranks, GB/s per rank, latency per ring step us, "
                       "latency per call us]",
        "shared_efficiency": "each rank's compute rate with one one-thread rank per core at once, over one alone",
        "attention_calls": "the CP attention op's forward + backward at a negligible size: a list of [ranks, "
                           "algorithm (ring, allgather, ulysses), kv-head chunks, us], the whole world one group"}
Link = tuple[int, float, float, float]  # (ranks, GB/s per rank, step latency us, call latency us)
Call = tuple[int, str, int, float]  # (ranks, algorithm, kv-head chunks, us)
ALGORITHMS = ("ring", "allgather", "ulysses")


@dataclass(frozen=True)
class CpuConstants:
    """One machine's CPU constants (see the module docstring)."""

    cores: int
    thread_speedup: float
    op_overhead_us: float
    collectives: tuple[Link, ...]
    shared_efficiency: float
    attention_calls: tuple[Call, ...]

    def threads(self, ranks: int) -> int:
        """Torch threads per rank when ``ranks`` processes share the machine."""
        return max(1, self.cores // max(1, ranks))

    def compute_scale(self, ranks: int) -> float:
        """A rank's compute rate over one thread's when ``ranks`` processes share the cores."""
        shared = self.shared_efficiency if ranks > 1 else 1.0
        if ranks > self.cores:
            return shared * self.cores / ranks
        if self.cores == 1:
            return 1.0
        return shared * (1.0 + (self.thread_speedup - 1.0) * (self.threads(ranks) - 1) / (self.cores - 1))

    def host_scale(self, ranks: int) -> float:
        """How much slower one rank's host work runs when ``ranks`` processes share the cores."""
        return max(1.0, ranks / self.cores)

    def link_at(self, ranks: int) -> tuple[float, float, float]:
        """``(GB/s per rank, step latency us, call latency us)`` of gloo at a world of ``ranks``."""
        return tuple(_by_world([(link[0], link[1:]) for link in self.collectives], ranks))  # type: ignore[return-value]

    def attention_call_us(self, algorithm: str, world: int, group: int, chunks: int) -> float:
        """Microseconds of one CP attention op call (forward + backward, arithmetic and bytes left out) of
        ``algorithm`` over a group of ``group`` ranks in a world of ``world``, with ``chunks`` kv-head chunks: the
        measured cost at the world size, linear in the chunks, in proportion to the group's ranks less one."""
        if group <= 1:
            return 0.0
        by_chunks = {}
        for chunk in (1, 2):
            points = [(w, (us,)) for w, a, c, us in self.attention_calls if a == algorithm and c == chunk]
            by_chunks[chunk] = _by_world(points, world)[0] if points else 0.0
        per_call = by_chunks[1] + max(0.0, by_chunks[2] - by_chunks[1]) * (chunks - 1)
        return per_call * (group - 1) / (max(world, 2) - 1)

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "thread_speedup": float(self.thread_speedup),
                "op_overhead_us": float(self.op_overhead_us),
                "collectives": [[int(r), float(b), float(s), float(c)] for r, b, s, c in self.collectives],
                "shared_efficiency": float(self.shared_efficiency),
                "attention_calls": [[int(w), a, int(c), float(us)] for w, a, c, us in self.attention_calls]}


def _by_world(points: list[tuple[int, tuple[float, ...]]], world: int) -> tuple[float, ...]:
    """``points`` (world size increasing) at ``world``: linear between them, the end values beyond."""
    if world <= points[0][0]:
        return points[0][1]
    for (w0, low), (w1, high) in zip(points, points[1:], strict=False):
        if world <= w1:
            t = (world - w0) / (w1 - w0)
            return tuple(a + t * (b - a) for a, b in zip(low, high, strict=True))
    return points[-1][1]


def _positive(value: Any, what: str, source: str, zero: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        raise InputError(f"{source}: cpu.{what} must be a number {'>= 0' if zero else '> 0'}, got {value!r}")
    return float(value)


def parse_cpu(value: Any, source: str) -> CpuConstants | None:
    """The ``cpu`` mapping of a hardware file (None: not a CPU profile); ``InputError`` naming the key otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(KEYS):
        raise InputError(f"{source}: cpu must be a mapping with exactly {', '.join(KEYS)} "
                         f"({'; '.join(f'{k}: {v}' for k, v in KEYS.items())})")
    cores = value["cores"]
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise InputError(f"{source}: cpu.cores must be an integer >= 1, got {cores!r}")
    speedup = _positive(value["thread_speedup"], "thread_speedup", source)
    if not 1.0 <= speedup <= cores:
        raise InputError(f"{source}: cpu.thread_speedup must be between 1 and cpu.cores ({cores}), got {speedup}")
    links = value["collectives"]
    if not isinstance(links, list) or not links:
        raise InputError(f"{source}: cpu.collectives must be a non-empty list ({KEYS['collectives']})")
    parsed = []
    for item in links:
        if not (isinstance(item, list | tuple) and len(item) == 4 and isinstance(item[0], int) and item[0] >= 2):
            raise InputError(f"{source}: cpu.collectives entries must be [ranks >= 2, GB/s, step us, call us], "
                             f"got {item!r}")
        parsed.append((item[0], _positive(item[1], "collectives GB/s", source),
                       _positive(item[2], "collectives step latency", source, zero=True),
                       _positive(item[3], "collectives call latency", source, zero=True)))
    if any(b[0] <= a[0] for a, b in zip(parsed, parsed[1:], strict=False)):
        raise InputError(f"{source}: cpu.collectives must list its world sizes increasing")
    efficiency = _positive(value["shared_efficiency"], "shared_efficiency", source)
    if efficiency > 1:
        raise InputError(f"{source}: cpu.shared_efficiency must be a fraction in (0, 1], got {efficiency}")
    calls = value["attention_calls"]
    if not isinstance(calls, list):
        raise InputError(f"{source}: cpu.attention_calls must be a list ({KEYS['attention_calls']})")
    parsed_calls = []
    for item in calls:
        if not (isinstance(item, list | tuple) and len(item) == 4 and isinstance(item[0], int) and item[0] >= 2
                and item[1] in ALGORITHMS and isinstance(item[2], int) and item[2] >= 1):
            raise InputError(f"{source}: cpu.attention_calls entries must be [ranks >= 2, one of "
                             f"{', '.join(ALGORITHMS)}, chunks >= 1, us], got {item!r}")
        parsed_calls.append((item[0], item[1], item[2], _positive(item[3], "attention_calls us", source, zero=True)))
    parsed_calls.sort(key=lambda call: call[0])
    return CpuConstants(cores, speedup, _positive(value["op_overhead_us"], "op_overhead_us", source, zero=True),
                        tuple(parsed), efficiency, tuple(parsed_calls))
