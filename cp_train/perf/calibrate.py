"""``cp-train-plan --calibrate OUT.yaml`` on a CUDA device: measure this GPU's compute and write a profile.

The profile starts from the built-in one for the detected GPU (``metrics.throughput.GPUS``; H100 when unknown)
and replaces what one GPU can measure about itself, each timing the median of CUDA-event timed repeats after a
warm-up:

- bf16 GEMM: a chain of linear layers' forward and backward (three matmuls per layer) of ``4d`` tokens and
  ``d`` -> ``2d`` features, by FLOPs per call (``16 d^3``), as a fraction of the datasheet's dense peak (the
  base profile's ``bf16_tflops``: the fractions stay comparable with the published curves);
- attention: the trainer's own kernels (``select_kernel``: cuDNN, and PyTorch's flash as the curve ``flash2``)
  forward + backward of ``L`` x ``L``, causal and full, GQA 2:1, head_dim 64 and 128, a batch of ``2**17``
  tokens or more, counted as ``workload.py`` counts (``4 * pairs * heads * head_dim``, backward 2.5x);
- HBM: a large device copy (bytes read + written per second);
- the host: the model's eager forward + backward at a size whose kernels are negligible, over the ops it
  dispatches (``host_op_us``), and cuDNN's first call at a new attention shape over a cached one, forward and
  backward (``graph_build_ms`` per graph).

The interconnect (NVLink, NIC, latencies) stays the base profile's: one GPU cannot measure it.
``quick=True`` measures a few sizes (seconds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cp_train.errors import InputError
from cp_train.metrics.throughput import gpu_entry
from cp_train.perf.inputs.hardware import AttentionCurve, Hardware, load_hardware
from cp_train.perf.rates import MEMORY_EFFICIENCY
from cp_train.perf.workload import ATTENTION_BACKWARD

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


def gemm_curve(dims: tuple[int, ...], peak_flops: float, layers: int = 4) -> list[tuple[float, float]]:
    """``[(FLOPs per matmul, fraction of peak)]`` of a chain of ``layers`` bf16 linears ``d -> 2d -> d ...`` over
    ``4d`` tokens, forward + backward through autograd (three matmuls each), for each ``d`` in ``dims``."""
    points = []
    for d in dims:
        weights = [torch.randn(*((2 * d, d) if i % 2 == 0 else (d, 2 * d)), device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for i in range(layers)]
        x = torch.randn(4 * d, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(weights: list[torch.Tensor] = weights, x: torch.Tensor = x) -> None:
            y = x
            for weight in weights:
                y = F.linear(y, weight)
            y.backward(torch.ones_like(y))

        flops = 2.0 * 4 * d * d * 2 * d
        points.append((flops, min(1.0, flops * 3 * layers / cuda_seconds(step) / peak_flops)))
    return points


def attention_curve(kernel_name: str, head_dim: int, causal: bool, lengths: tuple[int, ...], peak_flops: float
                    ) -> tuple[tuple[float, float], ...]:
    """``((L, fraction of peak), ...)`` of the trainer's kernel ``kernel_name`` forward + backward of ``L`` x ``L``,
    GQA 16:8 heads, a batch of ``2**17`` tokens or more."""
    from cp_train.parallel.kernels.contract import BackwardRows
    from cp_train.parallel.kernels.select import select_kernel

    kernel, points = select_kernel(torch.device("cuda"), torch.bfloat16, head_dim, kernel_name), []
    for length in lengths:
        kv_heads, batch, scale = 8, max(1, (1 << 17) // length), head_dim**-0.5
        q = torch.randn(batch, length, 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, length, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        out, lse = kernel.forward(q, k, v, causal, scale)
        rows = BackwardRows(torch.randn_like(out), q, out, lse)
        seconds = cuda_seconds(lambda: kernel.forward(q, k, v, causal, scale)) + cuda_seconds(  # noqa: B023
            lambda: kernel.backward(rows, k, v, causal, scale))  # noqa: B023 - timed before the loop moves on
        pairs = length * (length + 1) // 2 if causal else length * length
        flops = (1 + ATTENTION_BACKWARD) * 4.0 * pairs * batch * 2 * kv_heads * head_dim
        points.append((float(length), _sig(min(1.0, flops / seconds / peak_flops))))
    return tuple(points)


def copy_bandwidth(mib: int = 1024) -> float:
    """Bytes per second (read + written) of a device copy of ``mib`` MiB."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / cuda_seconds(lambda: target.copy_(source))


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.ops += 1
        return func(*args, **(kwargs or {}))


def host_op_seconds() -> float:
    """Host seconds per op of the model's eager forward + backward on this GPU at a negligible size."""
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel

    config = ModelConfig(vocab_size=64, num_layers=4, hidden_size=64, num_heads=2, num_kv_heads=1,
                         ffn_hidden_size=128, max_position_embeddings=64, tie_embeddings=True)
    model = GPTModel(config).cuda()
    tokens, labels = (torch.randint(0, 64, (1, 64), device="cuda") for _ in range(2))

    def step() -> None:
        model(tokens, labels=labels).sum().backward()

    step()
    with _OpCounter() as counter:
        step()
    torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats / counter.ops


def graph_build_seconds(shapes: int = 3) -> float:
    """Seconds cuDNN's attention spends building one execution graph: its first forward + backward at each of
    ``shapes`` new lengths less a second call at the same length, over two graphs (forward, backward)."""
    from cp_train.parallel.kernels.contract import BackwardRows
    from cp_train.parallel.kernels.select import select_kernel

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out, lse = kernel.forward(q, k, v, True, 128**-0.5)
        kernel.backward(BackwardRows(torch.ones_like(out), q, out, lse), k, v, True, 128**-0.5)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    kernel, builds = select_kernel(torch.device("cuda"), torch.bfloat16, 128, "cudnn"), []
    for length in range(1337, 1337 + 7 * shapes, 7):  # lengths no other call of this process used
        tensors = [torch.randn(1, length, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        first = call(*tensors)
        builds.append(max(0.0, first - call(*tensors)) / 2)
    return statistics.median(builds)


def base_profile() -> str:
    """The built-in profile of this GPU by its name (H100 SXM when the table has none)."""
    entry = gpu_entry(torch.cuda.get_device_name())
    return entry[1] if entry and entry[1] else "h100-sxm"


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
    host_op, build = host_op_seconds(), graph_build_seconds(1 if quick else 3)
    say(f"device copy {bandwidth / 1e12:.2f} TB/s; host {host_op * 1e6:.1f} us per op; a cuDNN graph "
        f"{build * 1e3:.1f} ms")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    notes = (f"calibrated {time.strftime('%Y-%m-%d')} on {torch.cuda.get_device_name()}, torch {torch.__version__}"
             f"{', quick' if quick else ''}: GEMM, attention and HBM measured here; the interconnect and the fp8 "
             f"curve are {base.name}'s; cp_train/perf/calibrate.py")
    # the time model runs memory-bound passes at MEMORY_EFFICIENCY of hbm_tb_s: store the copy's rate over it
    return replace(base, name=f"{base.name}-calibrated", notes=notes, hbm_gib=round(total, 2),
                   hbm_tb_s=_sig(bandwidth / 1e12 / MEMORY_EFFICIENCY),
                   gemm_bf16=tuple((flops, _sig(fraction)) for flops, fraction in gemm),
                   attention=tuple(curves), attention_kernel="cudnn", host_op_us=_sig(host_op * 1e6),
                   graph_build_ms=_sig(build * 1e3))


def write_profile(path: str | Path, quick: bool = False, log: Callable[[str], None] | None = None) -> Hardware:
    """Calibrate this machine's GPU and write the profile's YAML to ``path``; returns it. ``InputError`` without
    a CUDA device: the planner predicts GPUs."""
    if not torch.cuda.is_available():
        raise InputError("--calibrate measures a GPU and this machine has none: plan with a built-in profile "
                         "(--hardware), and use train.py --dry-run for a CPU run's memory")
    hardware = calibrate_gpu(quick, log)
    Path(path).write_text(f"# {hardware.notes}\n" + hardware.to_yaml(), encoding="utf-8")
    return hardware


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")
