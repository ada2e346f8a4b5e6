"""Throughput, FLOP/s, MFU and memory per logging interval (computed on every rank, emitted by one).

- tokens/s: tokens of the global batches (``global_batch_size * seq_len`` per step, masked ones
  included) over the interval's wall time; per device: divided by the world size.
- TFLOP/s per device: ``model_flops_per_token(model, seq_len)`` (model FLOPs, no recomputation; with
  per-document masks the attention counts the pairs the mask leaves, ``model.family.attention_flops``) times
  the global tokens/s, divided by the world size.
- ``mfu_dense`` / ``tflops_per_device_dense``: the same with attention counted in full (every key visible to
  every query, torchtitan's convention), where ``mfu`` counts what the causal (and document) mask leaves
  (NVIDIA's and Megatron's convention: causal attention at half).
- step time and peak memory: also the max over all ranks (``max_over_ranks``), memory as a percentage of
  the device's (``device_memory_gib``: CUDA's total memory, or the machine's ``MemTotal`` on CPU).
- MFU: TFLOP/s per device over the device's peak: ``logging.peak_tflops`` if set, else the dense
  bf16 tensor-core peak of the GPU found in ``GPUS`` by name, else ``logging.cpu_peak_tflops`` on CPU.
  A GPU missing from the table has no known peak: MFU is NaN (one warning names ``logging.peak_tflops``).
- attention imbalance: the busiest CP rank's attention work (query-key pairs under the mask) over the
  mean, per global batch, averaged over the interval (1.0: balanced; see the ``balanced`` CP layout).
- ``mfu_fp8_peak`` (runs with ``model.fp8``): the blocks' linears that compute in FP8 counted against the FP8
  peak (``FP8_PEAK_RATIO`` x the bf16 peak) and every other FLOP against the bf16 peak: the time the step's FLOPs
  take at those peaks over the measured time. ``mfu`` stays at the bf16 peak, comparable with bf16 runs.
- peak memory: CUDA's max allocated bytes (and max reserved, the allocator's cache included), or on
  CPU the process's peak RSS (``VmHWM``; it counts the freed memory glibc keeps for the next step,
  ``cp_train/memory/cpu_memory.py``, like CUDA's reserved bytes).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cp_train.model.config import ModelConfig
from cp_train.model.family import attention_flops, get_model_family, matmul_params, model_flops_per_token
from cp_train.results import StepResult

COLLECTIVE_HELPERS = ("max_over_ranks",)  # the collective trace (parallel/mesh/trace.py) names its callers

# Per device name: the dense bf16 tensor-core peak TFLOP/s (no sparsity, the vendors' data sheets) and the planner's
# hardware profile of that device where it has one (cp_train/perf/inputs/profiles; the profile's bf16_tflops is this
# peak). The one table of GPU names: the MFU's peak and the planner's run check both read it.
GPUS: dict[str, tuple[float, str | None]] = {
    "H200 NVL": (835.0, None), "H200": (989.0, "h200"),
    "H100 SXM": (989.0, "h100-sxm"), "H100 80GB HBM3": (989.0, "h100-sxm"), "H100 NVL": (835.0, None),
    "H100 PCIe": (756.0, None), "H100": (989.0, "h100-sxm"), "H800": (989.0, "h800"),
    "GH200": (989.0, None), "B200": (2250.0, "b200"), "B100": (1750.0, None),
    "A100": (312.0, "a100-80g"), "A800": (312.0, None), "A30": (165.0, None), "A10G": (70.0, None),
    "A10": (125.0, None), "L40S": (362.0, None), "L40": (181.0, None), "L4": (121.0, None),
    "RTX 4090": (165.2, None), "RTX A6000": (154.8, None), "RTX 3090": (71.0, None),
    "V100": (125.0, None),  # fp16
    "MI300X": (1307.0, None), "MI250X": (383.0, None),
}


# dense FP8 over dense bf16 tensor-core peak: 2 on Ada, Hopper and Blackwell (the vendors' data sheets; the planner's
# profiles hold fp8_tflops = 2 x bf16_tflops)
FP8_PEAK_RATIO = 2.0


def fp8_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token of the linears ``model.fp8`` computes in FP8 (those of ``model.fp8_blocks``,
    ``parallel/tp/fp8.py``): 6 x their weights; 0 without FP8."""
    if model.fp8 == "none":
        return 0.0
    linears = get_model_family(model.family).block_linears(model)
    return 6.0 * len(model.fp8_blocks) * sum(x.in_features * x.out_features for x in linears)


def gpu_entry(device_name: str) -> tuple[float, str | None] | None:
    """The table's entry whose name occurs in ``device_name`` (case, ``-`` and ``_`` ignored), longest match
    first: the NVL and PCIe parts get their own lower peaks (``NVIDIA H200 NVL`` 835, ``NVIDIA H200`` 989), or None."""
    def words(text: str) -> str:
        return " ".join(text.lower().replace("-", " ").replace("_", " ").split())

    found = words(device_name)
    for name in sorted(GPUS, key=len, reverse=True):
        if words(name) in found:
            return GPUS[name]
    return None


def gpu_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of ``device_name`` (``gpu_entry``), or None."""
    entry = gpu_entry(device_name)
    return entry[0] if entry else None


def implausible_mfu(mfu: float, peak_tflops: float, source: str) -> str | None:
    """A warning when the measured MFU is above 100%: the FLOPs or the peak are miscounted."""
    if mfu <= 1.0:
        return None
    return (f"measured MFU {mfu:.0%} is above 100% of {peak_tflops:g} TFLOP/s ({source}): the peak is wrong for this "
            f"device (set logging.peak_tflops) or the FLOPs are miscounted")


def peak_tflops(device: torch.device, override: float | None, cpu_peak: float) -> tuple[float, str]:
    """Per-device peak TFLOP/s and where it came from; NaN (with a warning) for a GPU not in the table."""
    if override:
        return override, "logging.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peak_tflops(name)
        if found is not None:
            return found, f"table ({name})"
        source = f"unknown GPU {name!r}: MFU is not reported; set logging.peak_tflops to its dense bf16 TFLOP/s"
        warnings.warn(source, RuntimeWarning, stacklevel=2)
        return math.nan, source
    return cpu_peak, "logging.cpu_peak_tflops"


def reset_peak_memory(device: torch.device) -> None:
    """Start a fresh peak: CUDA's counters, or the kernel's RSS high-water mark of this process."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then counts from the process start


def peak_memory_reserved_gib(device: torch.device) -> float | None:
    """Peak since ``reset_peak_memory`` of the CUDA caching allocator's reserved bytes; None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def device_memory_gib(device: torch.device) -> float | None:
    """The device's memory: CUDA's total, or the machine's ``MemTotal`` on CPU; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return _proc_gib("/proc/meminfo", "MemTotal")


def max_over_ranks(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """``values`` (host numbers) maxed element-wise over every rank of ``group``, a gloo group
    (``ParallelState.host_group``): a CPU collective that neither waits for the GPU nor queues on its stream
    (collective; the values themselves in a world of one)."""
    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def peak_memory_gib(device: torch.device) -> float:
    """Peak since ``reset_peak_memory``: CUDA max allocated, or ``VmHWM`` (peak RSS) on CPU; 0 if unknown."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return _proc_gib("/proc/self/status", "VmHWM") or 0.0


def _proc_gib(path: str, key: str) -> float | None:
    """GiB of the ``key:`` line (in kB) of a ``/proc`` file; None if unreadable."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024 / 2**30
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class IntervalMeter:
    """Accumulates the steps of one logging interval; ``record()`` turns them into a metrics dict."""

    tokens_per_step: int
    flops_per_token: float
    world_size: int
    peak_tflops: float
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    loss_sum: float = 0.0
    step_time: float = 0.0
    data_time: float = 0.0
    imbalance_sum: float = 0.0
    dense_flops_per_token: float = 0.0  # the matmuls' share of ``flops_per_token``
    flops_per_pair: float = 0.0  # attention FLOPs per visible query-key pair
    flops_sum: float = 0.0  # model FLOPs of the steps that counted their attention pairs
    flops_steps: int = 0
    full_flops_per_token: float = 0.0  # attention counted in full, every key visible (torchtitan's convention)
    fp8_flops_per_token: float = 0.0  # the FP8 linears' share of ``flops_per_token`` (``model.fp8``; 0: none)

    @classmethod
    def for_model(cls, model: ModelConfig, seq_len: int, global_batch: int, world_size: int,
                  peak: float) -> IntervalMeter:
        return cls(global_batch * seq_len, model_flops_per_token(model, seq_len), world_size, peak,
                   dense_flops_per_token=6.0 * matmul_params(model), flops_per_pair=attention_flops(model, 1),
                   full_flops_per_token=model_flops_per_token(model, seq_len, causal=False),
                   fp8_flops_per_token=fp8_flops_per_token(model))

    def add(self, loss: float, step_time: float, data_time: float, imbalance: float = 1.0,
            attention_pairs: float | None = None) -> None:
        """One step; ``attention_pairs``: the visible query-key pairs of its global batch under per-document
        masks (None: causal over each whole sample, as ``flops_per_token`` counts)."""
        self.steps += 1
        self.loss_sum += loss
        self.step_time += step_time
        self.data_time += data_time
        self.imbalance_sum += imbalance
        if attention_pairs is not None:
            self.flops_sum += self.dense_flops_per_token * self.tokens_per_step + self.flops_per_pair * attention_pairs
            self.flops_steps += 1

    def add_steps(self, steps: list[tuple[int, StepResult]], times: dict[int, tuple[float, float]]) -> None:
        """``add`` each of ``steps`` (``(step, scalars read to the host)``, in order) with its (step time, data
        time) popped from ``times``."""
        for step, out in steps:
            self.add(out.loss, *times.pop(step), out.imbalance, out.attention_pairs)

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (evaluation, checkpointing) out of the interval's wall time."""
        self.started += seconds

    def record(self, step: int, lr: float, grad_norm: float, consumed_samples: int, seq_len: int,
               memory_gib: float, memory_reserved_gib: float | None = None) -> dict[str, Any]:
        """Metrics of the interval ending at ``step``; restarts the interval."""
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        steps = max(self.steps, 1)
        tokens_per_s = self.tokens_per_step * self.steps / elapsed
        flops = self.flops_sum + (self.steps - self.flops_steps) * self.tokens_per_step * self.flops_per_token
        tflops = flops / elapsed / self.world_size / 1e12
        dense = self.full_flops_per_token * self.tokens_per_step * self.steps / elapsed / self.world_size / 1e12
        record = {
            "kind": "train", "step": step, "loss": self.loss_sum / steps, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "tflops_per_device": tflops, "mfu": tflops / self.peak_tflops if self.peak_tflops else 0.0,
            "tflops_per_device_dense": dense, "mfu_dense": dense / self.peak_tflops if self.peak_tflops else 0.0,
            "step_time_s": self.step_time / steps, "data_time_s": self.data_time / steps,
            "peak_memory_gib": memory_gib, "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_samples * seq_len, "attention_imbalance": self.imbalance_sum / steps,
        }
        if memory_reserved_gib is not None:
            record["peak_memory_reserved_gib"] = memory_reserved_gib
        if self.fp8_flops_per_token:  # the FP8 linears at the FP8 peak, the rest at bf16's
            fp8 = self.fp8_flops_per_token * self.tokens_per_step * self.steps
            at_peaks = fp8 / FP8_PEAK_RATIO + (flops - fp8)
            record["mfu_fp8_peak"] = (at_peaks / elapsed / self.world_size / 1e12 / self.peak_tflops
                                      if self.peak_tflops else 0.0)
        self.started, self.steps, self.loss_sum, self.step_time, self.data_time = now, 0, 0.0, 0.0, 0.0
        self.imbalance_sum, self.flops_sum, self.flops_steps = 0.0, 0.0, 0
        return record
