"""Where a training step's time goes: steps of a real ``train.py`` run under a scheduled ``torch.profiler``.

    torchrun --nproc-per-node 1 -m bench.step_profile --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 \\
        --set data.seq_len=16384 --set train.global_batch_size=2 --train-steps 12 --set schedule.warmup_steps=2

Runs ``train.py`` with its arguments; on rank 0 the profiler skips ``--skip`` optimizer steps (default 6:
compilation and warm-up), warms up on one and records ``--active`` steps (default 3) on a schedule, so its own
start and stop fall outside the recorded steps. The busy time is read from the trace: on CUDA the union of the
kernels' intervals on the device, on CPU the union of the main thread's top-level ops, over the span from the
first to the last of them; ``idle_fraction`` is the rest of that span. Prints one JSON line (``step_s``, ``busy_s``,
``idle_fraction``, the kernel seconds by kind on CUDA: matmul, attention, Inductor's fused kernels, other
memory-bound kernels, optimizer, copies, NCCL) and the 16 longest kernels or ops, each line prefixed ``PROFILE``;
at the end, the dense attention calls' new keys per step (``bench.cudnn_graphs.DenseKeys``: each one a graph cuDNN
builds on CUDA; on CPU the CPU kernel's, which builds none).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from bench.cudnn_graphs import DenseKeys
from cp_train import trainer
from cp_train.cli.train import main
from cp_train.parallel.kernels.cudnn import CudnnAttention
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash

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


def busy_events(events: Iterable[Any], cuda: bool) -> list[Any]:
    """The trace's busy events: CUDA kernels and copies on the device, or the CPU's top-level ops (no parent,
    not the profiler's own step markers)."""
    if cuda:
        return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    def top(event: Any) -> bool:
        parent = event.cpu_parent
        return parent is None or parent.name.startswith("ProfilerStep")

    return [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and top(e)
            and not e.name.startswith("ProfilerStep") and e.thread == main_thread(events)]


def main_thread(events: list[Any]) -> int:
    """The thread that ran the profiler's step markers (the training loop's)."""
    return next((e.thread for e in events if e.name.startswith("ProfilerStep")), 0)


def summary(events: list[Any], cuda: bool, steps: int) -> dict[str, Any]:
    """The JSON record of the recorded steps' ``events`` (``prof.events()``)."""
    busy = busy_events(events, cuda)
    busy_s, span_s = union_seconds((e.time_range.start, e.time_range.end) for e in busy)
    by_kind = collections.Counter()
    for event in busy:
        by_kind[kind(event.name) if cuda else "cpu op"] += event.time_range.elapsed_us()
    return {"device": "cuda" if cuda else "cpu", "steps": steps, "step_s": span_s / steps,
            "busy_s": busy_s / steps, "idle_fraction": 1 - busy_s / span_s if span_s else 0.0,
            "by_kind_s": {k: round(v / 1e6 / steps, 4) for k, v in by_kind.most_common()}}


def longest(events: list[Any], cuda: bool, count: int = 16) -> list[tuple[str, float]]:
    """The ``count`` kernels (ops on CPU) of most total time: (name, milliseconds)."""
    totals = collections.Counter()
    for event in busy_events(events, cuda):
        totals[event.name[:80]] += event.time_range.elapsed_us()
    return [(name, us / 1e3) for name, us in totals.most_common(count)]


def profiled_steps(original: Callable, skip: int, active: int, report: Callable[[list, bool, int], None],
                   keys: DenseKeys | None = None) -> Callable:
    """``Trainer._step`` wrapped: rank 0 runs its steps under a profiler that skips ``skip`` steps, warms up on
    one and records ``active``; ``report`` gets the recorded events when they are ready; ``keys`` (if given)
    learns each step's number."""
    state: dict[str, Any] = {"profiler": None}

    def wrapper(self, micro_batches, read):  # noqa: ANN001, ANN202 - Trainer._step's signature
        if keys is not None:
            keys.step = self.step + 1
        if self.state.rank != 0:
            return original(self, micro_batches, read)
        if state["profiler"] is None:
            cuda = self.device.type == "cuda"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            state["profiler"] = profile(
                activities=activities, schedule=schedule(skip_first=skip, wait=0, warmup=1, active=active, repeat=1),
                on_trace_ready=lambda prof: report(list(prof.events()), cuda, active))
            state["profiler"].start()
        out = original(self, micro_batches, read)
        state["profiler"].step()  # no synchronisation: the GPU's queue runs as in an unprofiled run
        return out

    return wrapper


def print_report(events: list, cuda: bool, steps: int) -> None:
    print("PROFILE " + json.dumps(summary(events, cuda, steps)), flush=True)
    for name, ms in longest(events, cuda):
        print(f"PROFILE {ms / steps:9.2f} ms/step  {kind(name) if cuda else 'cpu op':18s} {name}", flush=True)


def _take(argv: list[str], flag: str, default: int) -> int:
    if flag not in argv:
        return default
    at = argv.index(flag)
    value = int(argv[at + 1])
    del argv[at:at + 2]
    return value


if __name__ == "__main__":
    args = sys.argv[1:]
    skip_steps, active_steps = _take(args, "--skip", 6), _take(args, "--active", 3)
    dense_keys = DenseKeys()  # the dense attention calls' new keys per step (each a cuDNN graph on CUDA)
    trainer.Trainer._step = profiled_steps(trainer.Trainer._step, skip_steps, active_steps, print_report, dense_keys)
    with dense_keys.recording(CudnnAttention if torch.cuda.is_available() else TorchCpuFlash):
        code = main(args)
    steps = max(dense_keys.first_seen.values(), default=0)
    print("PROFILE " + json.dumps({"dense_kernel_keys": len(dense_keys.first_seen),
                                   "new_keys_by_step": dense_keys.new_by_step(steps)[1:]}), flush=True)
    sys.exit(code)
