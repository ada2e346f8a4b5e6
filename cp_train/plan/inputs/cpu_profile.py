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
in a training step) and interpolated linearly in the world size, the end values held beyond the measured ones; a
CP group smaller than the world costs its own size's figure, slowed as far as the world outnumbers the cores beyond
it.

Units: GB/s (1e9 B/s) per rank, microseconds.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable
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
                           "algorithm (ring, allgather, ulysses), kv-head chunks, us], the whole world one group",
        "linears": "optional: a linear layer's forward + backward by shape, a list of [tokens, in features, out "
                   "features, fraction of fp32_tflops] on a grid (absent: the gemm_fp32 curve by FLOPs)",
        "collective_kinds": "optional: gloo by collective as the trainer calls it, a list of [ranks, kind "
                            "(all_reduce, all_gather, reduce_scatter, all_to_all, p2p), GB/s per rank, latency per "
                            "ring step us, latency per call us] (absent: collectives for every kind)",
        "attention_bytes": "optional: the CP attention op's cost in a step above its kernels and its negligible-size "
                           "costs, per MiB of a call's q, k, v and output: a list of [ranks, algorithm, us per MiB]",
        "fsdp_units": "optional: FSDP2's cost per unit (a block or the root) of a forward + backward at a "
                      "negligible size, a list of [ranks, us] (absent: its collectives' latencies)",
        "adamw_bytes": "optional: the trainer's AdamW step per parameter, one thread, as the bytes a copy moves in "
                       "that time (absent: the 28 B fused AdamW reads and writes)",
        "attention_in_step": "optional: the CP attention op's cost per call between a layer's GEMMs beyond its cost "
                             "alone (ranks arriving apart): a list of [ranks, algorithm, us]"}
OPTIONAL = {"linears", "fsdp_units", "collective_kinds", "attention_bytes", "adamw_bytes", "attention_in_step"}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
Link = tuple[int, float, float, float]  # (ranks, GB/s per rank, step latency us, call latency us)
Call = tuple[int, str, int, float]  # (ranks, algorithm, kv-head chunks, us)
Linear = tuple[int, int, int, float]  # (tokens, in features, out features, fraction of the fp32 peak)
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
    linears: tuple[Linear, ...] = ()
    fsdp_units: tuple[tuple[int, float], ...] = ()
    collective_kinds: tuple[tuple[int, str, float, float, float], ...] = ()
    attention_bytes: tuple[tuple[int, str, float], ...] = ()
    adamw_bytes: float = 0.0  # 0: absent
    attention_in_step: tuple[tuple[int, str, float], ...] = ()

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
        measured cost linear in the chunks, as ``_at_group`` takes it."""
        by_chunks = {chunk: self._at_group([(w, a, us) for w, a, c, us in self.attention_calls if c == chunk],
                                           algorithm, world, group) for chunk in (1, 2)}
        return by_chunks[1] + max(0.0, by_chunks[2] - by_chunks[1]) * (chunks - 1)

    def attention_in_step_us(self, algorithm: str, world: int, group: int) -> float:
        """Microseconds one CP attention op call costs inside a step beyond its cost alone (``attention_in_step``)."""
        return self._at_group(self.attention_in_step, algorithm, world, group)

    def attention_byte_us(self, algorithm: str, world: int, group: int) -> float:
        """Microseconds per MiB of a CP attention op call's tensors (``attention_bytes``)."""
        return self._at_group(self.attention_bytes, algorithm, world, group)

    def _at_group(self, rows: Iterable[tuple[int, str, float]], algorithm: str, world: int, group: int) -> float:
        """``rows``' ``[ranks, algorithm, us]`` of ``algorithm`` (measured with the whole world one group) for a
        group of ``group`` ranks in a world of ``world``: the value at a world of ``group`` ranks, slowed as much as
        the world's ranks outnumber the cores beyond the group's (a pair of four ranks on two cores: twice a pair
        alone, measured within 5-25%); 0 when not measured."""
        points = [(w, (us,)) for w, a, us in rows if a == algorithm]
        if group <= 1 or not points:
            return 0.0
        return _by_world(points, group)[0] * self.host_scale(world) / self.host_scale(group)

    def kind_link_at(self, kind: str, ranks: int) -> tuple[float, float, float] | None:
        """``(GB/s per rank, step latency us, call latency us)`` of ``kind`` at a world of ``ranks``
        (``collective_kinds`` interpolated in the world size; None: that kind not measured)."""
        points = [(w, (gb, step, call)) for w, k, gb, step, call in self.collective_kinds if k == kind]
        return tuple(_by_world(points, ranks)) if points else None  # type: ignore[return-value]

    def fsdp_unit_us(self, ranks: int) -> float | None:
        """Microseconds per FSDP unit and micro-batch in a world of ``ranks`` (``fsdp_units`` interpolated linearly
        in the world size; None: not measured)."""
        if not self.fsdp_units:
            return None
        return _by_world([(w, (us,)) for w, us in self.fsdp_units], ranks)[0]

    @functools.cached_property
    def _linear_grid(self) -> tuple[dict[tuple[int, int, int], float], list[list[int]]]:
        """``linears`` as a lookup by shape and each dimension's grid values, sorted."""
        measured = {(a, b, c): f for a, b, c, f in self.linears}
        return measured, [sorted({point[i] for point in measured}) for i in range(3)]

    def linear_fraction(self, m: int, k: int, n: int, by_flops: Callable[[float], float]) -> float:
        """Fraction of the fp32 peak a linear of ``m`` tokens, ``k`` in and ``n`` out features reaches, forward and
        backward alike: the measured grid (``linears``) interpolated in log2 of each dimension, clamped to its
        edges; a grid point not measured (too large to time quickly), or no grid, takes ``by_flops(2 m k n)`` (the
        ``gemm_fp32`` curve)."""
        if not self.linears:
            return by_flops(2.0 * m * k * n)
        measured, axes = self._linear_grid
        corners = []
        for value, axis in zip((m, k, n), axes, strict=True):
            low = max([a for a in axis if a <= value], default=axis[0])
            high = min([a for a in axis if a >= value], default=axis[-1])
            t = 0.0 if high == low else (math.log2(value) - math.log2(low)) / (math.log2(high) - math.log2(low))
            corners.append(((low, 1.0 - t), (high, t)))
        total = 0.0
        for (a, wa), (b, wb), (c, wc) in itertools.product(*corners):
            if wa * wb * wc:
                fraction = measured.get((a, b, c))
                total += wa * wb * wc * (fraction if fraction is not None else by_flops(2.0 * a * b * c))
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "thread_speedup": float(self.thread_speedup),
                "op_overhead_us": float(self.op_overhead_us),
                "collectives": [[int(r), float(b), float(s), float(c)] for r, b, s, c in self.collectives],
                "shared_efficiency": float(self.shared_efficiency),
                "attention_calls": [[int(w), a, int(c), float(us)] for w, a, c, us in self.attention_calls],
                **({"linears": [[int(m), int(k), int(n), float(f)] for m, k, n, f in self.linears]}
                   if self.linears else {}),
                **({"fsdp_units": [[int(w), float(us)] for w, us in self.fsdp_units]} if self.fsdp_units else {}),
                **({"attention_bytes": [[int(w), a, float(us)] for w, a, us in self.attention_bytes]}
                   if self.attention_bytes else {}),
                **({"collective_kinds": [[int(w), k, float(gb), float(step), float(call)]
                                         for w, k, gb, step, call in self.collective_kinds]}
                   if self.collective_kinds else {}),
                **({"adamw_bytes": float(self.adamw_bytes)} if self.adamw_bytes else {}),
                **({"attention_in_step": [[int(w), a, float(us)] for w, a, us in self.attention_in_step]}
                   if self.attention_in_step else {})}


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


Column = Callable[[Any], Any]  # a checked value, or None when it is not one


def _whole(least: int) -> Column:
    return lambda x: x if isinstance(x, int) and not isinstance(x, bool) and x >= least else None


def _choice(options: tuple[str, ...]) -> Column:
    return lambda x: x if x in options else None


def _number(zero: bool) -> Column:
    def check(x: Any) -> float | None:
        ok = not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x) and (x > 0 or zero and x == 0)
        return float(x) if ok else None
    return check


def _rows(value: dict[str, Any], key: str, source: str, form: str, columns: tuple[Column, ...]) -> tuple[tuple, ...]:
    """The entries of the list ``cpu.<key>`` (absent: none), each checked column by column and sorted by the first;
    ``InputError`` naming the key and the entries' ``form`` otherwise."""
    entries = value.get(key) or []
    rows = []
    for item in entries if isinstance(entries, list) else [entries]:
        row = tuple(check(x) for check, x in zip(columns, item, strict=False)) if isinstance(item, list | tuple) else ()
        if len(row) != len(columns) or len(item) != len(columns) or any(x is None for x in row):
            raise InputError(f"{source}: cpu.{key} entries must be {form}, got {item!r}")
        rows.append(row)
    return tuple(sorted(rows, key=lambda row: row[0]))


def parse_cpu(value: Any, source: str) -> CpuConstants | None:
    """The ``cpu`` mapping of a hardware file (None: not a CPU profile); ``InputError`` naming the key otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"{source}: cpu must be a mapping with {', '.join(KEYS)} ({', '.join(OPTIONAL)} optional), "
                         f"got {type(value).__name__}")
    missing, unknown = sorted(set(KEYS) - OPTIONAL - set(value)), sorted(set(value) - set(KEYS))
    if missing:
        raise InputError(f"{source}: cpu lacks {', '.join(missing)} ("
                         f"{'; '.join(f'{k}: {KEYS[k]}' for k in missing)}); re-run cp-train-plan --calibrate")
    if unknown:
        raise InputError(f"{source}: cpu has unknown key(s) {', '.join(unknown)}: remove them (the keys are "
                         f"{', '.join(KEYS)})")
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
    if not isinstance(value["attention_calls"], list):
        raise InputError(f"{source}: cpu.attention_calls must be a list ({KEYS['attention_calls']})")
    algorithm, number, zero = _choice(ALGORITHMS), _number(zero=False), _number(zero=True)
    algorithms = ", ".join(ALGORITHMS)
    parsed_calls = _rows(value, "attention_calls", source, f"[ranks >= 2, one of {algorithms}, chunks >= 1, us]",
                         (_whole(2), algorithm, _whole(1), zero))
    parsed_linears = _rows(value, "linears", source, "[tokens, in, out (integers >= 1), fraction]",
                           (_whole(1), _whole(1), _whole(1), number))
    parsed_units = _rows(value, "fsdp_units", source, "[ranks >= 2, us]", (_whole(2), zero))
    parsed_kinds = _rows(value, "collective_kinds", source, f"[ranks >= 2, one of {', '.join(KINDS)}, GB/s, step us, "
                         "call us]", (_whole(2), _choice(KINDS), number, zero, zero))
    parsed_bytes = _rows(value, "attention_bytes", source, f"[ranks >= 2, one of {algorithms}, us per MiB]",
                         (_whole(2), algorithm, zero))
    parsed_in_step = _rows(value, "attention_in_step", source, f"[ranks >= 2, one of {algorithms}, us]",
                           (_whole(2), algorithm, zero))
    return CpuConstants(cores, speedup, _positive(value["op_overhead_us"], "op_overhead_us", source, zero=True),
                        tuple(parsed), efficiency, parsed_calls, parsed_linears, parsed_units, parsed_kinds,
                        parsed_bytes, _positive(value["adamw_bytes"], "adamw_bytes", source) if "adamw_bytes" in value
                        else 0.0, parsed_in_step)
