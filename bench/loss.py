"""The LM head and its cross entropy: peak memory and time of forward + backward, full logits against chunks.

    python -m bench.loss [--tokens 8192 --hidden 512 --vocab 32000 --chunks 0 4096 1024 256] [--rounds 3]

One process on CPU, fp32. Each case runs ``GPTModel._head_loss``'s two paths on the same ``x [tokens, hidden]``
and head weight: chunk 0 is the full logits (``vocab_parallel_cross_entropy`` of ``x @ W.T``); a chunk of
``c`` tokens is ``linear_cross_entropy`` (``cp_train.parallel.tp.fused_loss``). Peak: the RSS high-water
mark of a forward and backward above the RSS before it (the inputs and the weight's gradient buffer exist
already), the median over ``--rounds``; ``ratio``: the full path's peak over this one's.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import emit, median, peak_memory_mb, reset_peak_memory
from cp_train.parallel.tp.fused_loss import linear_cross_entropy
from cp_train.parallel.tp.layers import vocab_parallel_cross_entropy


def measure(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, rounds: int) -> dict:
    peaks, seconds = [], []
    for _ in range(rounds + 1):
        x.grad, weight.grad = torch.zeros_like(x), torch.zeros_like(weight)
        base = reset_peak_memory()
        start = time.perf_counter()
        if chunk:
            loss = linear_cross_entropy(x, weight, targets, None, chunk)
        else:
            loss = vocab_parallel_cross_entropy(x @ weight.t(), targets)
        loss.sum().backward()
        seconds.append(time.perf_counter() - start)
        peaks.append(peak_memory_mb() - base)
        del loss
    return {"chunk_tokens": chunk, "peak_mb": median(peaks[1:]), "ms": 1000 * median(seconds[1:])}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.loss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 1024, 256])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    records = [measure(x, weight, targets, chunk, args.rounds) for chunk in args.chunks]
    full = next((r["peak_mb"] for r in records if r["chunk_tokens"] == 0), None)
    for record in records:
        record.update(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab,
                      ratio=full / record["peak_mb"] if full and record["peak_mb"] > 0 else None)
    emit(records, [("chunk_tokens", "chunk tokens", str), ("peak_mb", "peak MB", "{:.0f}".format),
                   ("ratio", "full / this", lambda v: "" if v is None else f"{v:.1f}"),
                   ("ms", "ms", "{:.0f}".format)])
    return records


if __name__ == "__main__":
    main()
