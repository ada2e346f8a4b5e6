"""The SwiGLU's forward and backward: gate and up as two weights or one, autograd or one node, one process.

    python -m bench.swiglu [--tokens 4096 --hidden 1024 --ffn 2816] [--rounds 7] [--dtype fp32|bf16] [--device cpu]

Variants: ``two weights`` (``silu(x @ w_gate.T) * (x @ w_up.T)``, two matmuls: the MLP before gate and up became
one weight); on the fused ``[2 * ffn, hidden]`` weight (gate's and up's ``--block``-row blocks alternating), one
matmul: ``fused views`` (autograd on views of its output), ``fused`` (the matmul, then ``model/mlp.py``'s
``gated_silu``: what the MLP runs compiled and under FP8) and ``node`` (``swiglu``: what it runs eager); each eager
and compiled. They take turns call by call after ``--warmup`` calls each (compilation happens there); a variant's
time is the median of its ``--rounds``. ``kept_mb``: what autograd keeps for the backward (saved-tensor hooks, each
storage once; compiled, what Inductor's graph keeps). The table gives each time over the two weights' eager one.
On CUDA the times are synchronized.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/swiglu.py` from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import emit, median  # noqa: E402
from cp_train.model.config import gate_up_block  # noqa: E402
from cp_train.model.mlp import gate_up_pairs, gated_silu, pair_gate_up, swiglu  # noqa: E402


def two_weights(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def fused(x: torch.Tensor, w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    return gated_silu(F.linear(x, w_gate_up), block)


def fused_views(x: torch.Tensor, w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    gate, up = gate_up_pairs(F.linear(x, w_gate_up), block, -1)
    return (F.silu(gate) * up).flatten(-2)


# name -> (function, compiled, takes the fused weight)
VARIANTS: dict[str, tuple[Callable[..., torch.Tensor], bool, bool]] = {
    "two weights": (two_weights, False, False), "fused views": (fused_views, False, True),
    "fused": (fused, False, True), "node": (swiglu, False, True), "two weights compiled": (two_weights, True, False),
    "fused views compiled": (fused_views, True, True), "fused compiled": (fused, True, True),
    "node compiled": (swiglu, True, True)}


def kept_bytes(fn: Callable[..., torch.Tensor], inputs: tuple) -> int:
    """Bytes autograd keeps for ``fn``'s backward, each storage once."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def run(args: argparse.Namespace) -> list[dict]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    x, w_gate, w_up = (torch.randn(*shape, generator=g).to(args.device, dtype).requires_grad_()
                       for shape in ((1, args.tokens, args.hidden), (args.ffn, args.hidden), (args.ffn, args.hidden)))
    grad = torch.randn(1, args.tokens, args.ffn, generator=g).to(args.device, dtype)
    block = args.block or gate_up_block(args.ffn)
    w_gate_up = pair_gate_up(w_gate, w_up, block).detach().requires_grad_()
    inputs = {False: (x, w_gate, w_up), True: (x, w_gate_up)}
    extra = {False: (), True: (block,)}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    calls = {name: (torch.compile(fn) if compiled else fn, inputs[takes_fused])
             for name, (fn, compiled, takes_fused) in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(args.warmup + args.rounds):
        for name, (fn, weights) in calls.items():
            sync()
            start = time.perf_counter()
            torch.autograd.grad(fn(*weights, *extra[len(weights) == 2]), weights, grad)
            sync()
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    baseline = median(times["two weights"])
    return [{"variant": name, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "block": block,
             "dtype": args.dtype,
             "device": args.device, "threads": torch.get_num_threads(), "ms": 1000 * median(seconds),
             "vs_two_weights": median(seconds) / baseline, "rounds": args.rounds,
             "kept_mb": kept_bytes(calls[name][0], (*calls[name][1], *extra[len(calls[name][1]) == 2])) / 2**20}
            for name, seconds in times.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.swiglu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--block", type=int, default=0, help="gate/up rows per block (0: the model's rule)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    records = run(args)
    emit(records, [("variant", "variant", str), ("tokens", "tokens", str), ("block", "block", str),
                   ("ms", "ms", "{:.1f}".format), ("vs_two_weights", "vs two weights", "{:.3f}".format),
                   ("kept_mb", "kept MB", "{:.0f}".format)])
    return records


if __name__ == "__main__":
    main()
