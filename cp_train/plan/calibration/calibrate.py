"""``cp-train-plan --calibrate OUT.yaml``: measure this machine's CPU and write a hardware profile (``hardware.py``'s
format, ``compute_dtype: fp32``, with a ``cpu`` section: ``cpu_profile.py``) that ``--hardware OUT.yaml`` reads.

Measured, each timing the median of a few repeats (a shared machine is noisy), compute on one torch thread:

- fp32 GEMM: linear layers' forward and backward through autograd (three matmuls each) of ``4d`` tokens and
  ``d`` -> ``2d`` features (a block's projections) or ``d`` -> ``16d`` (an LM head), the host's time per op taken
  out, by FLOPs per call; the peak is the fastest;
- the CPU attention kernel (``TorchCpuFlash``, what the trainer runs on CPU): forward + backward of one call of
  ``L`` rows by ``L`` keys, causal and full, GQA (2 query heads per kv head), as a fraction of the peak, counting
  ``4 * pairs * heads * head_dim`` forward and 2.5x that backward (``workload.py``);
- memory bandwidth: a large copy (bytes read + written per second: what the time model's memory-bound passes
  run at on a CPU profile);
- host overhead per aten op: the model's own forward + backward (``GPTModel``) at a size whose arithmetic is
  negligible, over the ops it dispatches (counted with a dispatch mode);
- at 2, 4 and 8 spawned one-thread ranks (``calibrate_ranks.py``): gloo's all-reduce, all-gather and ring
  exchange of 4 KiB to 8 MiB, fitted to the time model's ``bytes / bandwidth + ring steps * step latency + call
  latency``; the CP attention op's own cost per call (ring, all-gather, Ulysses at a negligible size); the
  model's forward + backward (cpu-tiny's shape) on all the cores' threads over one (``thread_speedup``) and, at
  one rank per core, each rank's beside the others over one alone (``shared_efficiency``).

``quick=True`` measures a few small sizes and 2 ranks only (seconds; for tests).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cp_train.metrics.throughput import device_memory_gib
from cp_train.plan.calibration.calibrate_ranks import MODEL, measure_ranks
from cp_train.plan.calibration.op_bytes import attention_byte_costs, attention_in_step_costs
from cp_train.plan.inputs.cpu_profile import CpuConstants
from cp_train.plan.inputs.hardware import AttentionCurve, Hardware
from cp_train.plan.workload import ATTENTION_BACKWARD

KERNEL = "torch"  # the CPU attention backend's name (parallel/kernels/select.py)
GEMM_DIMS, GEMM_DIMS_QUICK = (8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768), (16, 64, 256)
LENGTHS, LENGTHS_QUICK = (32, 64, 128, 256, 512, 1024, 2048, 4096), (64, 256)
HEAD_DIMS, HEAD_DIMS_QUICK = (32, 64, 128), (32,)
WORLDS, WORLDS_QUICK = (2, 4, 8), (2,)
SIZES, SIZES_QUICK = (4096, 65536, 1 << 20, 8 << 20), (4096, 1 << 20)
# the linear-layer grid (tokens, in, out): each axis in powers of 4; shapes above LINEAR_MOST FLOPs (forward +
# backward) are left to the FLOPs curve (they run near the peak and take seconds to time)
LINEAR_TOKENS, LINEAR_FEATURES, LINEAR_OUT = (256, 1024, 4096), (64, 256, 1024, 4096), (64, 256, 1024, 4096, 16384)
LINEAR_QUICK = (256,), (64, 256), (64, 256)
LINEAR_MOST = 6e10


def seconds_per_call(fn: Callable[[], object], budget: float = 0.05, repeats: int = 5) -> float:
    """Median over ``repeats`` of the seconds per call of ``fn``, each repeat running ``budget`` seconds or more."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(budget / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def gemm_rates(dims: tuple[int, ...], overhead: float, widths: tuple[int, ...] = (2, 16), most: float = 3e9
               ) -> list[tuple[float, float]]:
    """``[(FLOPs per call, FLOP/s)]``, FLOPs increasing, of the matmuls of linear layers with ``4d`` tokens, ``d``
    and ``w * d`` features for each ``d`` in ``dims`` and ``w`` in ``widths`` (2: a block's projections; 16: an LM
    head's wide output), at most ``most`` FLOPs per call beyond the first width; shapes of equal FLOPs share a
    point (the FLOPs over their mean time). ``overhead``: host seconds per op, taken out (``op_overhead``)."""
    seconds: dict[float, list[float]] = {}
    for d in dims:
        for index, w in enumerate(widths):
            flops = 2.0 * 4 * d * d * w * d
            if index == 0 or flops <= most:
                seconds.setdefault(flops, []).append(_linear_seconds(4 * d, d, w * d, overhead))
    return [(flops, 3 * flops / statistics.mean(times)) for flops, times in sorted(seconds.items())]


def _linear_seconds(m: int, k: int, n: int, overhead: float, layers: int = 4) -> float:
    """Seconds of one linear layer's forward and backward (three matmuls of ``2 m n k`` FLOPs) as training runs
    them: a chain of ``layers`` linears ``k -> n -> k ...`` over ``m`` tokens through autograd, fresh activations
    each step, less ``overhead`` per op the chain dispatches."""
    import torch.nn.functional as F

    weights = [torch.randn(*((n, k) if i % 2 == 0 else (k, n)), requires_grad=True) for i in range(layers)]
    x = torch.randn(m, k, requires_grad=True)

    def step() -> None:
        y = x
        for weight in weights:
            y = F.linear(y, weight)
        y.sum().backward()

    step()
    with OpCounter() as counter:
        step()
    total = seconds_per_call(step, budget=0.1, repeats=3)
    return max(total - counter.ops * overhead, 0.1 * total) / layers


def linear_grid(peak: float, overhead: float, quick: bool = False) -> list[tuple[int, int, int, float]]:
    """``[(tokens, in, out, fraction of peak)]`` of a linear layer's forward + backward (``_linear_seconds``) on the
    grid (``LINEAR_*``), shapes over ``LINEAR_MOST`` FLOPs left out."""
    tokens, features, outs = LINEAR_QUICK if quick else (LINEAR_TOKENS, LINEAR_FEATURES, LINEAR_OUT)
    grid = []
    for m in tokens:
        for k in features:
            for n in outs:
                flops = 6.0 * m * k * n
                if flops <= LINEAR_MOST:
                    grid.append((m, k, n, _sig(flops / _linear_seconds(m, k, n, overhead, layers=2) / peak)))
    return grid


def attention_rate(length: int, head_dim: int, causal: bool) -> float:
    """FLOP/s of ``TorchCpuFlash``'s forward + backward of ``length`` x ``length`` (see the module docstring)."""
    from cp_train.parallel.kernels.contract import BackwardRows
    from cp_train.parallel.kernels.torch_ops import TorchCpuFlash

    kernel, kv_heads = TorchCpuFlash(), 2
    batch = max(1, 2048 // length)
    q = torch.randn(batch, length, 2 * kv_heads, head_dim)
    k, v = torch.randn(batch, length, kv_heads, head_dim), torch.randn(batch, length, kv_heads, head_dim)
    scale = head_dim**-0.5
    out, lse = kernel.forward(q, k, v, causal, scale)
    rows = BackwardRows(torch.randn_like(out), q, out, lse)
    seconds = seconds_per_call(lambda: kernel.backward(rows, k, v, causal, scale)) + seconds_per_call(
        lambda: kernel.forward(q, k, v, causal, scale))
    pairs = length * (length + 1) // 2 if causal else length * length
    return (1 + ATTENTION_BACKWARD) * 4.0 * pairs * batch * 2 * kv_heads * head_dim / seconds


def copy_bandwidth(mib: int = 128) -> float:
    """Bytes per second (read + write) of copying a ``mib`` MiB fp32 tensor."""
    source = torch.randn(mib * 2**18)
    target = torch.empty_like(source)
    return 2 * source.nbytes / seconds_per_call(lambda: target.copy_(source), budget=0.2)


def adamw_step_seconds(implementation: str = "auto", budget: float = 0.2) -> tuple[float, int]:
    """``(seconds, parameters)`` of one AdamW step (``build_optimizer`` with ``optimizer.implementation``) over
    cpu-tiny's parameters with random gradients, on the current threads."""
    from cp_train.config.schema import OptimizerConfig
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel
    from cp_train.optim import build_optimizer

    model = GPTModel(ModelConfig(**MODEL))
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer = build_optimizer(model, OptimizerConfig(implementation=implementation), torch.device("cpu"))
    return seconds_per_call(optimizer.step, budget=budget), sum(p.numel() for p in model.parameters())


def adamw_bytes(bandwidth: float) -> float:
    """The trainer's AdamW step (the default kernels) as the bytes per parameter a copy at ``bandwidth`` (bytes/s)
    moves in that time: fused AdamW moves 28 B from memory, but caches serve part of it and foreach's extra passes
    cost more."""
    seconds, params = adamw_step_seconds()
    return seconds * bandwidth / params


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active (``ops``): aten and c10d ops, and those inside the project's custom
    ops (the CP attention op's body runs under the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.ops += 1
        if func.namespace == "cp_train":
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def op_overhead(layers: int = 4) -> float:
    """Seconds per aten op of the model's forward + backward at a negligible size (``GPTModel``, cp 1)."""
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel

    config = ModelConfig(vocab_size=64, num_layers=layers, hidden_size=16, num_heads=2, num_kv_heads=1,
                         ffn_hidden_size=32, max_position_embeddings=8, tie_embeddings=True)
    model = GPTModel(config)
    tokens, labels = torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))

    def step() -> None:
        model(tokens, labels=labels).sum().backward()

    step()
    with OpCounter() as counter:
        step()
    return seconds_per_call(step, budget=0.1) / counter.ops


def calibrate(quick: bool = False, log: Callable[[str], None] | None = None) -> Hardware:
    """This machine's CPU profile (see the module docstring); ``log`` gets a line per measurement."""
    say = log or (lambda line: None)
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        overhead = op_overhead(2 if quick else 4)
        gemm = gemm_rates(GEMM_DIMS_QUICK if quick else GEMM_DIMS, overhead)
        # the peak from calls of 10 MFLOP or more: below, taking the host's time out of a few microseconds is noise
        peak = max(rate for flops, rate in gemm if flops >= 1e7 or flops == gemm[-1][0])
        say(f"fp32 GEMM, one thread: peak {peak / 1e9:.1f} GFLOP/s; " + ", ".join(
            f"{flops:.3g}: {min(1.0, rate / peak):.2f}" for flops, rate in gemm))
        linears = linear_grid(peak, overhead, quick)
        say("linears (tokens x in -> out: fraction of the peak): " + ", ".join(
            f"{m}x{k}->{n}: {f:.2f}" for m, k, n, f in linears))
        curves = []
        for head_dim in HEAD_DIMS_QUICK if quick else HEAD_DIMS:
            for causal in (True, False):
                points = tuple((float(n), _sig(min(1.0, attention_rate(n, head_dim, causal) / peak)))
                               for n in (LENGTHS_QUICK if quick else LENGTHS) if n * head_dim <= 4096 * 64)
                curves.append(AttentionCurve(KERNEL, head_dim, causal, points))
                say(f"attention hd {head_dim} {'causal' if causal else 'full'}: " + ", ".join(
                    f"{n:.0f}: {f:.3f}" for n, f in points))
        bandwidth = copy_bandwidth(32 if quick else 128)
        optimizer = adamw_bytes(bandwidth)
        say(f"copy {bandwidth / 1e9:.2f} GB/s; host overhead {overhead * 1e6:.2f} us per op; AdamW as {optimizer:.1f} "
            f"copied bytes per parameter")
    finally:
        torch.set_num_threads(threads)
    worlds, sizes = (WORLDS_QUICK, SIZES_QUICK) if quick else (WORLDS, SIZES)
    links, calls, efficiency, speedup, units, kinds, sized, in_step = measure_ranks(worlds, sizes, cores,
                                                                                     3 if quick else 5, say)
    links = [(ranks, _sig(gb_s), _sig(step_us), _sig(call_us)) for ranks, gb_s, step_us, call_us in links]
    _, gb_s, step_us, call_us = links[0]
    cpu = CpuConstants(cores, _sig(speedup), _sig(overhead * 1e6), tuple(links), _sig(efficiency),
                       tuple((w, a, c, _sig(us)) for w, a, c, us in calls), tuple(linears),
                       tuple((w, _sig(us)) for w, us in units),
                       tuple((w, k, _sig(gb), _sig(step), _sig(call)) for w, k, gb, step, call in kinds),
                       adamw_bytes=_sig(optimizer))
    notes = (f"calibrated {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()} "
             f"({_cpu_model()}), {cores} cores, torch {torch.__version__}{', quick' if quick else ''}: rates per "
             f"core (one thread); cp_train/plan/calibration/calibrate.py")
    hardware = Hardware(name="cpu-calibrated", bf16_tflops=0.0, fp8_tflops=0.0,
                        hbm_gib=round(device_memory_gib(torch.device("cpu")) or 16.0, 2),
                        hbm_tb_s=_sig(bandwidth / 1e12), nvlink_gb_s=gb_s, nvlink_efficiency=1.0,
                        nvlink_latency_us=step_us, net_gb_s=gb_s, net_efficiency=1.0, net_latency_us=step_us,
                        collective_latency_us=call_us,
                        gemm_bf16=(), gemm_fp8=(), attention=tuple(curves), attention_kernel=KERNEL,
                        gpus_per_node=1024, notes=notes, compute_dtype="fp32", fp32_tflops=_sig(peak / 1e12),
                        gemm_fp32=tuple((flops, _sig(min(1.0, rate / peak))) for flops, rate in gemm), cpu=cpu)
    per_call = attention_in_step_costs(hardware, in_step, say)  # on the rates just measured
    hardware = replace(hardware, cpu=replace(cpu, attention_in_step=tuple((w, a, _sig(us)) for w, a, us in per_call)))
    per_byte = attention_byte_costs(hardware, sized, say)  # beyond the in-step cost just measured
    return replace(hardware, cpu=replace(hardware.cpu,
                                         attention_bytes=tuple((w, a, _sig(us)) for w, a, us in per_byte)))


def _sig(value: float, digits: int = 4) -> float:
    """``value`` rounded to ``digits`` significant figures (the profile stays readable)."""
    return float(f"{value:.{digits}g}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def write_profile(path: str | Path, quick: bool = False, log: Callable[[str], None] | None = None) -> Hardware:
    """Calibrate this machine (its GPU when CUDA is available: ``calibrate_gpu.py``; else its CPU) and write the
    profile's YAML to ``path``; returns it."""
    if torch.cuda.is_available():
        from cp_train.plan.calibration.calibrate_gpu import calibrate_gpu

        hardware = calibrate_gpu(quick, log)
    else:
        hardware = calibrate(quick, log)
    Path(path).write_text(f"# {hardware.notes}\n" + hardware.to_yaml(), encoding="utf-8")
    return hardware
