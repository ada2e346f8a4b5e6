"""Where a training step's GPU time goes: one step of a real ``train.py`` run under ``torch.profiler``.

    torchrun --nproc-per-node 1 -m bench.step_profile --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 \\
        --set data.seq_len=16384 --set train.global_batch_size=2 --train-steps 9 --set schedule.warmup_steps=2

Runs ``train.py`` with its arguments and profiles optimizer step ``--profile-step`` (default 7: after
compilation and warm-up) on rank 0: prints one JSON line (``wall_s``, the GPU's busy seconds, the kernel seconds
by kind: matmul, attention, Inductor's fused kernels, other memory-bound kernels, optimizer, copies, NCCL) and
the table of the 16 longest kernels, each line prefixed ``PROFILE``. CUDA only (the profiler's device times).
"""

from __future__ import annotations

import collections
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cp_train import trainer
from cp_train.cli.train import main

KINDS = (("attention", ("fmha", "flash", "cudnn", "attn", "sdpa")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")),
         ("optimizer", ("multi_tensor", "adam")), ("copy", ("memcpy", "memset")), ("nccl", ("nccl",)),
         ("fused (Inductor)", ("triton",)))


def kind(kernel: str) -> str:
    """The kind of a CUDA kernel, by its name (first match in ``KINDS``; else other memory-bound)."""
    name = kernel.lower()
    return next((label for label, keys in KINDS if any(key in name for key in keys)), "other memory-bound")


def profiled_step(original, step: int):  # noqa: ANN001, ANN201 - wraps Trainer._step
    calls = [0]

    def wrapper(self, micro_batches, read):  # noqa: ANN001, ANN202 - Trainer._step's signature
        calls[0] += 1
        if calls[0] != step or not torch.cuda.is_available() or self.state.rank != 0:
            return original(self, micro_batches, read)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = original(self, micro_batches, read)
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        by_kind, by_kernel = collections.Counter(), collections.Counter()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Optimizer."):
                by_kind[kind(event.name)] += event.device_time_total
                by_kernel[event.name[:80]] += event.device_time_total
        print("PROFILE " + json.dumps({"step": step, "wall_s": wall, "gpu_busy_s": sum(by_kind.values()) / 1e6,
                                       "by_kind_s": {k: round(v / 1e6, 4) for k, v in by_kind.most_common()}}),
              flush=True)
        for name, us in by_kernel.most_common(16):
            print(f"PROFILE {us / 1e3:9.2f} ms  {kind(name):18s} {name}", flush=True)
        return out

    return wrapper


if __name__ == "__main__":
    argv = sys.argv[1:]
    step = 7
    if "--profile-step" in argv:
        at = argv.index("--profile-step")
        step = int(argv[at + 1])
        del argv[at:at + 2]
    trainer.Trainer._step = profiled_step(trainer.Trainer._step, step)
    sys.exit(main(argv))
