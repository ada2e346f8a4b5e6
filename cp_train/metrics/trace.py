"""Where a profiled step's time went, read from ``torch.profiler``'s events (``prof.events()``).

The busy time is the union of the device's kernel and copy intervals on CUDA (the step markers and other
annotations the profiler draws on the device's timeline are not busy time), or of the training thread's top-level
ops on CPU, over the span from the first to the last of them; the idle fraction is the rest of the span (the device
waiting on the host: launches, Python, reads). The kernels are grouped by kind from their names. ``copies``: the
device time of the copy ops (``aten::copy_`` and the like), by op, input shapes and the region that ran them (the
trace's shapes: the profiler records them). ``fp8_s``: with FP8 linears, their GEMMs' and their dynamic scales'
device time.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch

KINDS = (("attention", ("fmha", "flash", "cudnn", "attn", "sdpa")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")),
         ("optimizer", ("multi_tensor", "adam")), ("copy", ("memcpy", "memset")), ("nccl", ("nccl",)),
         ("fused (Inductor)", ("triton",)))


def kind(kernel: str) -> str:
    """The kind of a CUDA kernel, by its name (first match in ``KINDS``; else other memory-bound)."""
    name = kernel.lower()
    return next((label for label, keys in KINDS if any(key in name for key in keys)), "other memory-bound")


def union_seconds(intervals: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(the union's length, the span from the first start to the last end) of ``(start, end)`` intervals in
    microseconds, in seconds."""
    busy, span_start, span_end, reach = 0.0, None, None, None
    for start, end in sorted(intervals):
        span_start = start if span_start is None else span_start
        span_end = end if span_end is None else max(span_end, end)
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy / 1e6, ((span_end - span_start) / 1e6 if span_start is not None else 0.0)


def main_thread(events: list[Any]) -> int:
    """The thread that ran the profiler's step markers (the training loop's)."""
    return next((e.thread for e in events if e.name.startswith("ProfilerStep")), 0)


def annotation(event: Any) -> bool:
    """Whether a device event is a range the profiler or ``record_function`` marks on the GPU's timeline (the
    trace's ``gpu_user_annotation``: ``ProfilerStep#N`` spans the whole step), not a kernel or a copy."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("ProfilerStep")


def busy_events(events: list[Any], cuda: bool) -> list[Any]:
    """The trace's busy events: CUDA kernels and copies on the device (not the annotations over them), or the
    CPU's top-level ops (no parent, not the profiler's own step markers) on the training thread."""
    if cuda:
        return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not annotation(e)]
    thread = main_thread(events)

    def top(event: Any) -> bool:
        parent = event.cpu_parent
        return parent is None or parent.name.startswith("ProfilerStep")

    return [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and top(e)
            and not e.name.startswith("ProfilerStep") and e.thread == thread]


def fp8_seconds(events: list[Any], busy: list[Any]) -> dict[str, float]:
    """The device seconds FP8 linears spend, on CUDA: ``gemm``, the kernels ``aten::_scaled_mm`` launched (also
    from a compiled graph; part of ``matmul``), and ``scales``, the kernels that take an absolute maximum (named
    after both ``abs`` and ``max``: torchao's ``max(abs(x))`` as Inductor fuses it, ``triton_red_fused_abs_max_...``;
    an eager run's separate abs and max kernels are not counted; part of their kinds). Empty without FP8."""
    gemm = sum(k.duration for e in events if e.name == "aten::_scaled_mm" for k in (e.kernels or ()))
    scales = sum(e.time_range.elapsed_us() for e in busy if "abs" in e.name.lower() and "max" in e.name.lower())
    return {"gemm": gemm / 1e6, "scales": scales / 1e6} if gemm else {}


def summary(events: list[Any], cuda: bool, steps: int) -> dict[str, Any]:
    """The recorded steps' figures, per step: ``step_s`` (the busy span), ``busy_s``, ``idle_fraction``,
    ``by_kind_s`` (kernel seconds by kind on CUDA; ``cpu op`` on CPU) and, with FP8 linears, ``fp8_s``
    (``fp8_seconds``)."""
    busy = busy_events(events, cuda)
    busy_s, span_s = union_seconds((e.time_range.start, e.time_range.end) for e in busy)
    by_kind: collections.Counter = collections.Counter()
    for event in busy:
        by_kind[kind(event.name) if cuda else "cpu op"] += event.time_range.elapsed_us()
    fp8 = fp8_seconds(events, busy) if cuda else {}
    return {"device": "cuda" if cuda else "cpu", "steps": steps, "step_s": span_s / steps,
            "busy_s": busy_s / steps, "idle_fraction": 1 - busy_s / span_s if span_s else 0.0,
            "by_kind_s": {k: round(v / 1e6 / steps, 4) for k, v in by_kind.most_common()},
            **({"fp8_s": {k: round(v / steps, 4) for k, v in fp8.items()}} if fp8 else {})}


def longest(events: list[Any], cuda: bool, count: int = 16) -> list[tuple[str, float]]:
    """The ``count`` kernels (ops on CPU) of most total time: (name, milliseconds over all recorded steps)."""
    totals: collections.Counter = collections.Counter()
    for event in busy_events(events, cuda):
        totals[event.name[:80]] += event.time_range.elapsed_us()
    return [(name, us / 1e3) for name, us in totals.most_common(count)]


COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::index_copy_", "aten::cat")


def _region(event: Any) -> str:
    """The outermost op above ``event`` below the step marker (a compiled graph's call, autograd's backward node, a
    module's op): where a copy came from."""
    region = event
    while region.cpu_parent is not None and not region.cpu_parent.name.startswith("ProfilerStep"):
        region = region.cpu_parent
    return region.name[:60]


def copies(events: list[Any], count: int = 8) -> list[tuple[str, float]]:
    """The ``count`` copy ops (``COPY_OPS``) of most device time, grouped by (op, input shapes, region): (label,
    milliseconds of their kernels over all recorded steps). Empty on CPU (no device kernels)."""
    totals: collections.Counter = collections.Counter()
    for event in events:
        if event.name in COPY_OPS and event.kernels:
            shapes = [list(s) for s in getattr(event, "input_shapes", None) or [] if s]
            label = f"{event.name} {shapes} in {_region(event)}"
            totals[label[:160]] += sum(k.duration for k in event.kernels)
    return [(label, us / 1e3) for label, us in totals.most_common(count)]
