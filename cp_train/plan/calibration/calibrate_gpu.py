"""``cp-train-plan --calibrate OUT.yaml`` on a CUDA device: measure this GPU's compute and write a profile.

The profile starts from the built-in one for the detected GPU (``metrics/prediction.py``'s name table; H100
when unknown) and replaces what one GPU can measure about itself, each timing the median of CUDA-event timed
repeats after a warm-up:

- bf16 GEMM: a chain of linear layers' forward and backward (three matmuls per layer) of ``4d`` tokens and
  ``d`` -> ``2d`` features, by FLOPs per call (``16 d^3``), as a fraction of the datasheet's dense peak (the
  base profile's ``bf16_tflops``: the fractions stay comparable with the published curves);
- attention: the trainer's own kernels (``select_kernel``: cuDNN, and PyTorch's flash as the curve ``flash2``)
  forward + backward of ``L`` x ``L``, causal and full, GQA 2:1, head_dim 64 and 128, a batch of ``2**17``
  tokens or more, counted as ``workload.py`` counts (``4 * pairs * heads * head_dim``, backward 2.5x);
- HBM: a large device copy (bytes read + written per second).

The interconnect (NVLink, NIC, latencies) stays the base profile's: one GPU cannot measure it.
``quick=True`` measures a few sizes (seconds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from cp_train.plan.inputs.hardware import AttentionCurve, Hardware, load_hardware
from cp_train.plan.rates import MEMORY_EFFICIENCY
from cp_train.plan.workload import ATTENTION_BACKWARD

GEMM_DIMS, GEMM_DIMS_QUICK = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144), (256, 1024, 4096)
LENGTHS, LENGTHS_QUICK = (1024, 2048, 4096, 8192, 16384, 32768), (2048, 8192)
HEAD_DIMS = (64, 128)
KERNELS = {"cudnn": "cudnn", "torch": "flash2"}  # trainer backend -> curve name (PyTorch's CUDA flash is FA2)


def cuda_seconds(fn: Callable[[], object], repeats: int = 5, budget: float = 0.03) -> float:
    """Median seconds per call of ``fn`` on the current CUDA stream, each repeat ``budget`` seconds or more."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(1, int(budget / max(time.perf_counter() - start, 1e-6)))
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(begin.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(samples)


def gemm_curve(dims: tuple[int, ...], peak_flops: float) -> list[tuple[float, float]]:
    """``[(FLOPs per matmul, fraction of peak)]`` of bf16 linears ``d -> 2d -> d ...`` over ``4d`` tokens,
    forward + backward through autograd, for each ``d`` in ``dims``."""
    points = []
    for d in dims:
        flops = 2.0 * 4 * d * d * 2 * d
        points.append((flops, min(1.0, flops / _matmul_seconds(d) / peak_flops)))
    return points


def _matmul_seconds(d: int, layers: int = 4) -> float:
    """Seconds per matmul of a chain of ``layers`` bf16 linears' forward + backward (three matmuls each)."""
    weights = [torch.randn(*((2 * d, d) if i % 2 == 0 else (d, 2 * d)), device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for i in range(layers)]
    x = torch.randn(4 * d, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        y = x
        for weight in weights:
            y = F.linear(y, weight)
        y.backward(torch.ones_like(y))

    return cuda_seconds(step) / (3 * layers)


def attention_curve(kernel_name: str, head_dim: int, causal: bool, lengths: tuple[int, ...], peak_flops: float
                    ) -> tuple[tuple[float, float], ...]:
    """``((L, fraction of peak), ...)`` of one kernel's forward + backward of ``L`` x ``L`` calls."""
    points = []
    for length in lengths:
        seconds, flops = _attention_seconds(kernel_name, head_dim, causal, length)
        points.append((float(length), _sig(min(1.0, flops / seconds / peak_flops))))
    return tuple(points)


def _attention_seconds(kernel_name: str, head_dim: int, causal: bool, length: int) -> tuple[float, float]:
    """(seconds, FLOPs) of one forward + backward of ``kernel_name`` over ``L`` x ``L``, GQA 16:8 heads, a batch
    of ``2**17`` tokens or more."""
    from cp_train.parallel.kernels.contract import BackwardRows
    from cp_train.parallel.kernels.select import select_kernel

    kernel = select_kernel(torch.device("cuda"), torch.bfloat16, head_dim, kernel_name)
    kv_heads, batch, scale = 8, max(1, (1 << 17) // length), head_dim**-0.5
    q = torch.randn(batch, length, 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, length, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, lse = kernel.forward(q, k, v, causal, scale)
    rows = BackwardRows(torch.randn_like(out), q, out, lse)
    seconds = cuda_seconds(lambda: kernel.forward(q, k, v, causal, scale)) + cuda_seconds(
        lambda: kernel.backward(rows, k, v, causal, scale))
    pairs = length * (length + 1) // 2 if causal else length * length
    return seconds, (1 + ATTENTION_BACKWARD) * 4.0 * pairs * batch * 2 * kv_heads * head_dim


def copy_bandwidth(mib: int = 1024) -> float:
    """Bytes per second (read + written) of a device copy of ``mib`` MiB."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / cuda_seconds(lambda: target.copy_(source))


def base_profile() -> str:
    """The built-in profile of this GPU by its name (H100 SXM when the name is not in the table)."""
    from cp_train.metrics.prediction import device_profile

    return device_profile(torch.cuda.get_device_name()) or "h100-sxm"


def calibrate_gpu(quick: bool = False, log: Callable[[str], None] | None = None) -> Hardware:
    """This GPU's profile (see the module docstring); ``log`` gets a line per measurement."""
    say = log or (lambda line: None)
    base = load_hardware(base_profile())
    peak = base.bf16_tflops * 1e12
    gemm = gemm_curve(GEMM_DIMS_QUICK if quick else GEMM_DIMS, peak)
    say(f"bf16 GEMM (fraction of {base.bf16_tflops:.0f} TFLOP/s): " + ", ".join(
        f"{flops:.3g}: {fraction:.3f}" for flops, fraction in gemm))
    curves = []
    for backend, kernel in KERNELS.items():
        for head_dim in HEAD_DIMS:
            for causal in (True, False):
                points = attention_curve(backend, head_dim, causal, LENGTHS_QUICK if quick else LENGTHS, peak)
                curves.append(AttentionCurve(kernel, head_dim, causal, points))
                say(f"attention {kernel} hd {head_dim} {'causal' if causal else 'full'}: " + ", ".join(
                    f"{n:.0f}: {f:.3f}" for n, f in points))
    bandwidth = copy_bandwidth(256 if quick else 2048)
    say(f"device copy {bandwidth / 1e12:.2f} TB/s")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    notes = (f"calibrated {time.strftime('%Y-%m-%d')} on {torch.cuda.get_device_name()}, torch {torch.__version__}"
             f"{', quick' if quick else ''}: GEMM, attention and HBM measured here; the interconnect and the fp8 "
             f"curve are {base.name}'s; cp_train/plan/calibration/calibrate_gpu.py")
    # the time model runs memory-bound passes at MEMORY_EFFICIENCY of hbm_tb_s: store the copy's rate over it
    return replace(base, name=f"{base.name}-calibrated", notes=notes, hbm_gib=round(total, 2),
                   hbm_tb_s=_sig(bandwidth / 1e12 / MEMORY_EFFICIENCY),
                   gemm_bf16=tuple((flops, _sig(fraction)) for flops, fraction in gemm),
                   attention=tuple(curves), attention_kernel="cudnn")


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")
