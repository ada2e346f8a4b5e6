"""Where a training step's time goes: steps of a real ``train.py`` run under the trainer's scheduled profiler.

    torchrun --nproc-per-node 1 -m bench.step_profile --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 \\
        --set data.seq_len=16384 --set train.global_batch_size=2 --train-steps 12 --set schedule.warmup_steps=2

Runs ``train.py`` with its arguments and ``--profile`` (``cp_train/runtime/profiling.py``): rank 0 skips ``--skip``
optimizer steps (default 6: compilation and warm-up), warms the profiler up on one and records ``--active`` steps
(default 3), so its own start and stop fall outside them; the trace lands in the run directory's ``profile/``. The
busy time is read from the trace (``cp_train/metrics/trace.py``): on CUDA the union of the kernels' intervals on the
device, on CPU the union of the training thread's top-level ops, over the span from the first to the last of them;
``idle_fraction`` is the rest of that span. Prints one JSON line (``step_s``, ``busy_s``, ``idle_fraction``, the
kernel seconds by kind on CUDA: matmul, attention, Inductor's fused kernels, other memory-bound kernels, optimizer,
copies, NCCL; with FP8 linears ``fp8_s``: their GEMMs' and their scales' seconds) and the 16 longest kernels or ops,
each line prefixed ``PROFILE``; at the end, the dense attention calls' new keys per step
(``bench.cudnn_graphs.DenseKeys``: each one a graph cuDNN builds on CUDA; on CPU the CPU kernel's, which builds
none).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from bench.cudnn_graphs import DenseKeys
from cp_train.cli.train import main
from cp_train.metrics.trace import kind
from cp_train.parallel.kernels.cudnn import CudnnAttention
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from cp_train.runtime.profiling import StepProfiler


def profile_flags(skip: int, active: int) -> list[str]:
    """``train.py``'s flags that record steps ``skip + 2 .. skip + 1 + active`` (after ``skip`` and one warm-up)."""
    return ["--profile", "--profile-step-start", str(skip + 2), "--profile-step-end", str(skip + 2 + active)]


def print_report(record: dict[str, Any]) -> None:
    """The ``PROFILE`` lines of the trainer's ``profile`` record."""
    keys = ("device", "step_s", "busy_s", "idle_fraction", "by_kind_s", "fp8_s", "profiled_steps", "trace")
    print("PROFILE " + json.dumps({key: record[key] for key in keys if key in record}), flush=True)
    for name, ms in record["longest_ms"]:
        label = kind(name) if record["device"] == "cuda" else "cpu op"
        print(f"PROFILE {ms:9.2f} ms/step  {label:18s} {name}", flush=True)
    for name, ms in record.get("copies_ms", []):  # the copy ops' kernels, by op, shapes and region
        print(f"PROFILE {ms:9.2f} ms/step  {'copy op':18s} {name}", flush=True)


def run(argv: list[str], skip: int = 6, active: int = 3) -> tuple[int, list[dict[str, Any]], DenseKeys]:
    """``train.py argv`` with the profile of ``active`` steps after ``skip``: (exit code, the profile records, the
    dense attention keys by step). The records are printed as they come."""
    records: list[dict[str, Any]] = []
    dense_keys = DenseKeys()  # the dense attention calls' new keys per step (each a cuDNN graph on CUDA)
    before, after = StepProfiler.before_step, StepProfiler.after_step

    def counting(self: StepProfiler, step: int) -> None:
        dense_keys.step = step
        before(self, step)

    def reporting(self: StepProfiler, step: int) -> dict[str, Any] | None:
        record = after(self, step)
        if record is not None and record["rank"] == 0:
            records.append(record)
            print_report(record)
        return record

    StepProfiler.before_step, StepProfiler.after_step = counting, reporting  # type: ignore[method-assign]
    try:
        with dense_keys.recording(CudnnAttention if torch.cuda.is_available() else TorchCpuFlash):
            code = main([*argv, *profile_flags(skip, active)])
    finally:
        StepProfiler.before_step, StepProfiler.after_step = before, after  # type: ignore[method-assign]
    return code, records, dense_keys


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
    exit_code, _, keys = run(args, skip_steps, active_steps)
    steps = max(keys.first_seen.values(), default=0)
    print("PROFILE " + json.dumps({"dense_kernel_keys": len(keys.first_seen),
                                   "new_keys_by_step": keys.new_by_step(steps)[1:]}), flush=True)
    sys.exit(exit_code)
