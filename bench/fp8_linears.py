"""A block's linears alone, bf16 against FP8, at a config's shapes: the most FP8 linears can save of a step.

    python -m bench.fp8_linears                            # GPU: the 1B config's linears at 16,384 tokens
    python -m bench.fp8_linears --bf16-step 0.373          # and the best FP8 step of a measured bf16 step
    python -m bench.fp8_linears --tokens 8192 --set model.hidden_size=4096 --set model.ffn_hidden_size=14336
    python -m bench.fp8_linears --tiny                     # CPU: tiny shapes (a smoke test)

For each linear of a block (``ModelFamily.block_linears``: qkv, attention out, MLP gate+up, MLP down; TP-local at
the config's ``parallel.tp``, ``--set parallel.tp=2``) with ``--tokens`` rows, and each of bf16, tensorwise and
rowwise (``model.fp8``), and tensorwise-fast (``rowwise-fast`` when asked): the recipe with every GEMM accumulating
fast (``model.fp8_fast_accum=all``; the recipes accumulate the backward's two slowly):

- ``gemm``: the linear's three GEMMs (output = x W^T, grad input = dy W, grad weight = dy^T x) on operands made
  beforehand: bf16 ``torch.mm``, or ``torch._scaled_mm`` with the recipe's dtypes, scales, operand layouts and
  fast-accumulation flags as torchao 0.18's ``Float8LinearConfig`` sets them (tensorwise: e4m3 x e4m3 forward,
  e5m2 gradients, one scale per tensor; rowwise: e4m3 throughout, a scale per row or column). The tensor cores'
  rate: milliseconds, TFLOP/s and the fraction of the peak (bf16's or FP8's, ``FP8_PEAK_RATIO``), the numbers the
  planner's GEMM curves hold (``cp_train/perf/inputs/profiles``: ``gemm_bf16``, ``gemm_fp8``), and beside them
  the planner's time for the same GEMMs on ``--hardware`` (h200; its FP8 curve is derived, not measured).
- ``linear``: the layer's forward and backward as the trainer runs it (``F.linear`` under bf16 autocast on an
  fp32 weight, or ``parallel/tp/fp8.py``'s ``Float8Matmul``), compiled on CUDA (``--eager``: not), its weight's
  fp32 gradient included: the GEMMs plus every cast FP8 adds, for one linear on its own (in a whole compiled
  block Inductor may fuse some casts into their neighbours, so this bounds FP8's cost from above).

For tensorwise the gemm rows also give ``cast_ms``: the bytes its casts move as torchao 0.18 runs them
(``TENSORWISE_CAST_BYTES``: each operand's absolute maximum, its cast and a transposed copy for the backward) at the
planner's memory rate on ``--hardware``, a count, not a measurement (``fp8-profile`` in ``bench/gpu_acceptance.sh``
measures them). The totals add a block's linears and multiply by the layers. With ``--bf16-step S`` (a measured bf16
step of ``--samples`` samples of ``--tokens``: ``bench.fp8``'s bf16 run), the best FP8 step: S minus what FP8 saves
over the layers' linears, and the speedup that caps; with the counted casts added back, ``with casts``; the issue's
bar is tensorwise at 1.2x. JSON lines, then a table.
Shapes the GPU's FP8 GEMMs refuse stop the bench first with the config's one line (``check_fp8_shapes``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/fp8_linears.py` from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import emit, fp8_variant  # noqa: E402
from bench.gpu import time_call  # noqa: E402
from cp_train.config.fp8_shapes import check_fp8_shapes, local_linears  # noqa: E402
from cp_train.config.schema import Config, ConfigError  # noqa: E402
from cp_train.config.sources import build_config, flatten, parse_override, read_yaml  # noqa: E402
from cp_train.metrics.throughput import FP8_PEAK_RATIO, gpu_peak_tflops  # noqa: E402
from cp_train.parallel.tp.fp8 import FAST_ACCUM, Float8Matmul, float8_config, fp8_unavailable  # noqa: E402
from cp_train.perf.calibrate import cuda_seconds  # noqa: E402
from cp_train.perf.inputs.hardware import load_hardware  # noqa: E402
from cp_train.perf.rates import DeviceRates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "launch" / "configs" / "gpt-1b-128k-cp8.yaml"
RECIPES = ("bf16", "tensorwise", "rowwise", "tensorwise-fast", "rowwise-fast")  # -fast: model.fp8_fast_accum=all
TINY = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.ffn_hidden_size": 128, "model.max_position_embeddings": 128}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# tensorwise as the trainer runs it (``Float8Matmul``: each operand cast once, torchao 0.18's matmul; the joint graph
# AOTAutograd partitions, ``tests/model/test_fp8.py``): bytes per element of each operand, each absolute maximum one
# read, each cast one read and one FP8 write, each transposed FP8 copy (the backward's GEMMs take the other layout)
# one read and one write. The input (bf16): amax 2, cast 3, transposed copy 2; the output's gradient (bf16): the
# same; the weight (fp32 master; bf16 when FSDP gathers it so): amax 4, cast 5, transposed copy 2.
TENSORWISE_CAST_BYTES = {"input": 7, "grad": 7, "weight": {4: 11, 2: 7}}


def tensorwise_cast_bytes(tokens: int, in_f: int, out_f: int, weight_bytes: int = 4) -> int:
    """Bytes one tensorwise linear's casts move in a forward and backward (``TENSORWISE_CAST_BYTES``)."""
    table = TENSORWISE_CAST_BYTES
    return tokens * (in_f * table["input"] + out_f * table["grad"]) + in_f * out_f * table["weight"][weight_bytes]


def seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one ``fn()``: on CUDA the calibration's event-timed rounds (``cuda_seconds``: no sync per
    call, which short GEMMs would time), on the CPU ``repeats`` calls after two."""
    return cuda_seconds(fn) if device.type == "cuda" else time_call(fn, device, 2, repeats)


def _scaled(x: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``dtype`` with its inverse scale: one per tensor (``dim`` None) or one per slice along ``dim``'s
    complement (amax over ``dim``, kept), powers of two as torchao's rowwise recipe rounds them."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = torch.finfo(dtype).max / amax.float().clamp(min=1e-12)
    if dim is not None:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (x.float() * scale).to(dtype), scale.reciprocal()


@functools.cache
def row_scales_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes row and column scales on ``device`` (CUDA's FP8 GEMMs do; on CPU torch
    2.13 does, 2.11 takes one scale per tensor only): tried once on a 16 x 16 product."""
    a = torch.ones(16, 16, device=device).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1, device=device), torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def gemm_calls(recipe: str, tokens: int, in_f: int, out_f: int, device: torch.device,
               fast: tuple[bool, bool, bool]) -> list[tuple[str, Callable[[], object]]]:
    """The three GEMMs of one linear (output, grad input, grad weight), each with operands made beforehand in the
    layouts ``_scaled_mm`` takes (A row-major, B column-major); ``fast``: each GEMM's fast accumulation."""
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) * in_f ** -0.5
    dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
    if recipe == "bf16":
        wt, dyt = w.t().contiguous(), dy.t().contiguous()
        return [("output", lambda: torch.mm(x, wt)), ("grad input", lambda: torch.mm(dy, w)),
                ("grad weight", lambda: torch.mm(dyt, x))]
    rowwise = recipe.startswith("rowwise")
    grad_dtype = E4M3 if rowwise else E5M2

    def pair(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_dtype: torch.dtype, use_fast: bool
             ) -> Callable[[], object]:  # a [m, k] @ b [k, n]: a row-major, b column-major, scales by row / column
        a8, a_scale = _scaled(a.contiguous(), a_dtype, 1 if rowwise else None)
        b8, b_scale = _scaled(b.t().contiguous(), b_dtype, 1 if rowwise else None)  # [n, k] row-major
        b8, b_scale = b8.t(), b_scale.t() if rowwise else b_scale
        if rowwise and not row_scales_supported(device):  # dequantized operands, multiplied in fp32
            return lambda: ((a8.float() * a_scale) @ (b8.float() * b_scale)).to(torch.bfloat16)
        return lambda: torch._scaled_mm(a8, b8, a_scale, b_scale, out_dtype=torch.bfloat16, use_fast_accum=use_fast)

    return [("output", pair(x, E4M3, w.t(), E4M3, fast[0])), ("grad input", pair(dy, grad_dtype, w, E4M3, fast[1])),
            ("grad weight", pair(dy.t(), grad_dtype, x, E4M3, fast[2]))]


def recipe_config(recipe: str, device: torch.device) -> Any:
    """torchao's config of a recipe row (``tensorwise-fast``: tensorwise with ``fast_accum`` all, ``fp8_variant``),
    emulated off CUDA."""
    name, fast_accum = fp8_variant(recipe)
    return float8_config(name, emulate=device.type != "cuda", fast_accum=fast_accum)


def linear_call(recipe: str, tokens: int, in_f: int, out_f: int, device: torch.device, compiled: bool
                ) -> Callable[[], object]:
    """One forward and backward of the layer's matmul as the trainer runs it (bf16 autocast, an fp32 weight)."""
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(out_f, in_f, device=device) * in_f ** -0.5)
    dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
    matmul = F.linear if recipe == "bf16" else Float8Matmul(recipe_config(recipe, device))

    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matmul(a, b)

    if compiled:
        torch._dynamo.reset()  # each linear's own graph: one code object would meet the recompile limit
        forward = torch.compile(forward, dynamic=False)

    def step() -> None:
        x.grad = weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = forward(x, weight)
        y.backward(dy)

    return step


def bench_config(args: argparse.Namespace) -> Config:
    """``--config`` with ``--set`` (``--tiny``: a tiny model) as one sample of ``--tokens`` at cp 1, with FP8 on when
    a recipe asks for it, so that ``check_fp8_shapes`` judges these GEMMs' shapes."""
    values = flatten(read_yaml(Path(args.config)), args.config)
    values.update(TINY if args.tiny else {})
    values.update({"data.seq_len": args.tokens, "parallel.cp": 1, "train.micro_batch_size": 1, "model.mlp_chunks": 1,
                   "model.fp8": next((fp8_variant(r)[0] for r in args.recipes if r != "bf16"), "none")})
    return build_config([("bench.fp8_linears", values), ("--set", dict(parse_override(o) for o in args.overrides))])


def measure(args: argparse.Namespace, config: Config, device: torch.device, peak: float | None
            ) -> list[dict[str, Any]]:
    """One record per (recipe, linear, part: gemm or linear), then per (recipe, part) totals over the model; the
    gemm rows with the planner's time for them on ``--hardware`` (``DeviceRates.matmul``)."""
    hardware = load_hardware(args.hardware)
    layers = config.model.num_layers
    compiled = device.type == "cuda" and not args.eager
    records: list[dict[str, Any]] = []
    for recipe in args.recipes:
        fast = FAST_ACCUM["none" if recipe == "bf16" else fp8_variant(recipe)[1]]  # as float8_config sets them
        rate = peak * (1 if recipe == "bf16" else FP8_PEAK_RATIO) if peak else None
        planner = DeviceRates(hardware, "bf16" if recipe == "bf16" else "fp8")
        tensorwise = recipe.startswith("tensorwise")
        for linear, (out_f, in_f) in local_linears(config):
            flops = 2.0 * args.tokens * in_f * out_f  # one GEMM's
            shape = {"recipe": recipe, "linear": linear.name, "tokens": args.tokens, "in": in_f, "out": out_f}
            if "gemm" in args.parts:
                gemm_s = {name: seconds(fn, device, args.repeats)
                          for name, fn in gemm_calls(recipe, args.tokens, in_f, out_f, device, fast)}
                records.append({**shape, "part": "gemm", "fast_accum": list(fast), "ms": 1e3 * sum(gemm_s.values()),
                                "planned_ms": 3e3 * flops / planner.matmul(args.tokens, out_f, in_f),
                                "cast_ms": 1e3 * tensorwise_cast_bytes(args.tokens, in_f, out_f)
                                / planner.memory_bytes_per_s if tensorwise else None,
                                "tflops": 3 * flops / sum(gemm_s.values()) / 1e12,
                                "gemms": {name: {"flops": flops, "ms": 1e3 * s, "tflops": flops / s / 1e12,
                                                 "of_peak": flops / s / 1e12 / rate if rate else None}
                                          for name, s in gemm_s.items()}})
            if "linear" in args.parts:
                linear_s = seconds(linear_call(recipe, args.tokens, in_f, out_f, device, compiled), device,
                                   args.repeats)
                records.append({**shape, "part": "linear", "ms": 1e3 * linear_s,
                                 "tflops": 3 * flops / linear_s / 1e12})
    for recipe in args.recipes:
        for part in args.parts:
            rows = [r for r in records if r["recipe"] == recipe and r["part"] == part]
            block = sum(r["ms"] for r in rows)
            planned = sum(r["planned_ms"] for r in rows) * layers if part == "gemm" else None
            casts = [r.get("cast_ms") for r in rows]
            cast_ms = sum(casts) * layers if part == "gemm" and casts and None not in casts else None
            records.append({"recipe": recipe, "linear": f"model ({layers} blocks)", "part": part,
                            "tokens": args.tokens, "ms": block * layers, "block_ms": block, "planned_ms": planned,
                            "cast_ms": cast_ms})
    return records


def compare(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each record's speedup over bf16's (same linear and part); on the model totals with ``--bf16-step``, the
    best FP8 step (the measured bf16 step less the linears' saving over ``--samples`` samples) and its speedup."""
    base = {(r["linear"], r["part"]): r["ms"] for r in records if r["recipe"] == "bf16"}
    for record in records:
        bf16 = base.get((record["linear"], record["part"]))
        record["speedup"] = bf16 / record["ms"] if bf16 and record["ms"] else None
        if args.bf16_step and bf16 is not None and record["linear"].startswith("model"):
            saved = (bf16 - record["ms"]) * args.samples / 1e3
            record["best_step_s"] = args.bf16_step - saved
            record["step_speedup_cap"] = args.bf16_step / record["best_step_s"]
            if record.get("cast_ms") is not None:  # the GEMMs' saving less the counted casts
                record["step_with_casts_s"] = record["best_step_s"] + record["cast_ms"] * args.samples / 1e3
                record["speedup_with_casts"] = args.bf16_step / record["step_with_casts_s"]


def _number(form: str) -> Callable[[object], str]:
    return lambda value: "-" if value is None else form.format(value)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--tokens", type=int, default=16384, help="rows of each linear (tokens of one sample)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES[:4]))
    parser.add_argument("--parts", nargs="+", choices=("gemm", "linear"), default=["gemm", "linear"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="the linear rows uncompiled (CPU: always)")
    parser.add_argument("--bf16-step", type=float, default=None, help="a measured bf16 step (s), for the cap")
    parser.add_argument("--samples", type=int, default=1, help="samples of --tokens in that step")
    parser.add_argument("--hardware", default="h200", help="the planner's profile for the planned GEMM times")
    parser.add_argument("--tiny", action="store_true", help="a tiny model at 64 tokens, 3 repeats (CPU smoke)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.repeats = min(args.tokens, 64), min(args.repeats, 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for recipe in set(args.recipes) - {"bf16"}:
        problem = fp8_unavailable(fp8_variant(recipe)[0], device)
        if problem is not None:
            raise SystemExit(f"bench.fp8_linears: {problem}")
    config = bench_config(args)
    try:
        check_fp8_shapes(config)
    except ConfigError as error:
        raise SystemExit(f"bench.fp8_linears (--tokens is data.seq_len): {error}") from None
    peak = gpu_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    records = measure(args, config, device, peak)
    compare(records, args)
    emit(records, [("recipe", "recipe", str), ("linear", "linear", str), ("part", "part", str),
                   ("ms", "ms", _number("{:.3f}")), ("planned_ms", "planned ms", _number("{:.3f}")),
                   ("tflops", "TFLOP/s", _number("{:.0f}")),
                   ("speedup", "vs bf16", _number("{:.2f}x")), ("best_step_s", "best step s", _number("{:.3f}")),
                   ("step_speedup_cap", "step cap", _number("{:.2f}x")),
                   ("cast_ms", "casts ms", _number("{:.1f}")),
                   ("speedup_with_casts", "with casts", _number("{:.2f}x"))])
    return records


if __name__ == "__main__":
    main()
