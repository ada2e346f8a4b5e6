"""The SwiGLU's forward and backward: one autograd node (``model/mlp.py``'s ``swiglu``) against autograd, one process.

    python -m bench.swiglu [--tokens 4096 --hidden 1024 --ffn 2816] [--rounds 7] [--dtype fp32|bf16] [--device cpu]

Variants: ``autograd`` (``silu(x @ w_gate.T) * (x @ w_up.T)``, what the MLP runs compiled), ``node``
(``swiglu``, what it runs eager), each eager and compiled. They take turns call by call after ``--warmup`` calls
each (compilation happens there); a variant's time is the median of its ``--rounds``. ``kept_mb``: what
autograd keeps for the backward (saved-tensor hooks, each storage once; compiled, what Inductor's graph keeps).
The table gives each time over autograd's eager one. On CUDA the times are synchronized.
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
from cp_train.model.mlp import swiglu  # noqa: E402


def plain(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


VARIANTS: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {
    "autograd": (plain, False), "node": (swiglu, False), "autograd compiled": (plain, True),
    "node compiled": (swiglu, True)}


def kept_bytes(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> int:
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
    weights = (x, w_gate, w_up)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    calls = {name: torch.compile(fn) if compiled else fn for name, (fn, compiled) in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(args.warmup + args.rounds):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            torch.autograd.grad(fn(*weights), weights, grad)
            sync()
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    baseline = median(times["autograd"])
    return [{"variant": name, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "dtype": args.dtype,
             "device": args.device, "threads": torch.get_num_threads(), "ms": 1000 * median(seconds),
             "vs_autograd": median(seconds) / baseline, "rounds": args.rounds,
             "kept_mb": kept_bytes(calls[name], *weights) / 2**20}
            for name, seconds in times.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.swiglu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    records = run(args)
    emit(records, [("variant", "variant", str), ("tokens", "tokens", str), ("ms", "ms", "{:.1f}".format),
                   ("vs_autograd", "vs autograd", "{:.3f}".format), ("kept_mb", "kept MB", "{:.0f}".format)])
    return records


if __name__ == "__main__":
    main()
