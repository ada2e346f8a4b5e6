"""One CP rank's attention work per layer as PyTorch's own context parallel runs it (load-balanced causal, fp32
merges), on one GPU: the kernels alone against the kernels with the framework's elementwise passes.

    python -m bench.torch_cp_rank                                   # torchtitan's 128k row: cp 4, 32 heads
    python -m bench.torch_cp_rank --heads 8 --kv-heads 8            # NeMo's Llama 2-7B 128K row: tp 4 x cp 4
    python -m bench.torch_cp_rank --device cpu --tiny               # the same code on CPU at toy sizes

What it answers: whether the published long-sequence rows (``bench/planner_published.py``) spend their time in
the kernels at the planner's curves or in the CP framework around them. The calls are those of rank ``r`` of
``cp`` ranks with ``--seq`` local rows (two round-robin chunks), as ``torch.distributed.tensor.experimental.
_attention`` (Dec 2024, the torchtitan benchmark's torch) issues them: step 0 causal over the whole local block,
steps ``i <= r`` all queries against the first half of the arriving keys, steps ``i > r`` the second half of the
queries against all of them. ``framework`` adds its passes: each block's out and lse cast to fp32 and merged
(``out - sigmoid(lse_b - lse) * (out - out_b)``, the chunk and concatenate of a partial update), the kv and dK/dV
send buffers concatenated, dq and dK/dV accumulated in fp32. Communication is not run; the timing is the
same-shaped work on random inputs, not an exact attention. ``ratio``: framework time over the kernels'.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import emit
from bench.gpu import time_call
from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows

Call = tuple[str, bool]  # ("all" | "khalf" | "qhalf", causal)


def rank_calls(rank: int, cp: int) -> list[Call]:
    """The kernel calls of one rank's ring steps: step 0 causal, then key halves (i <= rank) or query halves."""
    return [("all", True) if i == 0 else (("khalf", False) if i <= rank else ("qhalf", False)) for i in range(cp)]


def rank_pairs(rank: int, cp: int, rows: int) -> float:
    """Query-key pairs the rank's calls compute (a causal call's diagonal included)."""
    return sum(rows * (rows + 1) / 2 if causal else rows * rows / 2 for _, causal in rank_calls(rank, cp))


def _operands(kind: str, q, k, v, half: int):
    if kind == "qhalf":
        return q[:, half:], k, v
    if kind == "khalf":
        return q, k[:, :half], v[:, :half]
    return q, k, v


def rank_forward(kernel: AttentionKernel, calls: list[Call], q, k, v, scale: float, framework: bool):
    """The rank's forward calls; with ``framework``, each block merged into fp32 ``[B, H, S, D]`` out and
    ``[B, H, S, 1]`` lse as PyTorch's ring attention merges them. Returns (out, lse) of the first call or the merge."""
    half, merged = q.shape[1] // 2, None
    for kind, causal in calls:
        out, lse = kernel.forward(*_operands(kind, q, k, v, half), causal, scale)
        if not framework:
            merged = merged or (out, lse)
            continue
        block_out, block_lse = out.float().transpose(1, 2), lse.float().unsqueeze(-1)
        if merged is None:
            merged = (block_out, block_lse)
            continue
        partial = kind == "qhalf"
        cur_out, cur_lse = (x.chunk(2, dim=2)[1] if partial else x for x in merged)
        new_out = cur_out - torch.sigmoid(block_lse - cur_lse) * (cur_out - block_out)
        new_lse = cur_lse - torch.nn.functional.logsigmoid(cur_lse - block_lse)
        if partial:
            merged = tuple(torch.cat([x.chunk(2, dim=2)[0], y], dim=2)
                           for x, y in zip(merged, (new_out, new_lse), strict=True))
        else:
            merged = (new_out, new_lse)
    if framework:
        return merged[0].to(q.dtype).transpose(1, 2), merged[1].squeeze(-1)
    return merged


def rank_backward(kernel: AttentionKernel, calls: list[Call], q, k, v, out, lse, dout, scale: float,
                  framework: bool) -> None:
    """The rank's backward calls (each given the final out/lse); with ``framework``, dq and dK/dV accumulated in
    fp32 and the kv and dK/dV send buffers concatenated, as PyTorch's ring attention backward does."""
    half = q.shape[1] // 2
    if framework:
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
    for step, (kind, causal) in enumerate(calls):
        rows = BackwardRows(dout, q, out, lse)
        if kind == "qhalf":
            rows = BackwardRows(dout[:, half:], q[:, half:], out[:, half:], lse[:, :, half:].contiguous())
        _, keys, values = _operands(kind, q, k, v, half)
        if framework and step > 0:
            torch.cat([k.flatten(), v.flatten()])  # the next kv's send buffer
        grads = kernel.backward(rows, keys, values, causal, scale)
        if not framework:
            continue
        if kind == "khalf":
            dk, dv = (torch.cat([acc.chunk(2, dim=1)[0] + g, acc.chunk(2, dim=1)[1]], dim=1)
                      for acc, g in ((dk, grads[1]), (dv, grads[2])))
        else:
            dk += grads[1]
            dv += grads[2]
        torch.cat([dk.flatten(), dv.flatten()])  # the dK/dV send buffer
        if kind == "qhalf":
            dq = torch.cat([dq.chunk(2, dim=1)[0], dq.chunk(2, dim=1)[1] + grads[0]], dim=1)
        else:
            dq += grads[0]
    if framework:
        dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)  # the accumulators cast back: part of the timed work


def _time_rank(kernel: AttentionKernel, calls: list[Call], tensors: tuple, scale: float, device: torch.device,
               repeats: int) -> dict[str, float]:
    """Milliseconds of the rank's forward and backward, kernels alone and with the framework's passes."""
    q, k, v, out, lse, dout = tensors
    times = {}
    for name, framework in (("kernels", False), ("framework", True)):
        forward = time_call(lambda f=framework: rank_forward(kernel, calls, q, k, v, scale, f), device, 1, repeats)
        backward = time_call(lambda f=framework: rank_backward(kernel, calls, q, k, v, out, lse, dout, scale, f),
                             device, 1, repeats)
        times.update({f"{name}_forward_ms": forward * 1e3, f"{name}_backward_ms": backward * 1e3})
    return times


def bench(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, heads, kv_heads, d = args.seq, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, rows, heads, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, rows, kv_heads, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    scale, records = d ** -0.5, []
    for backend in args.backends:
        try:
            kernel = kernels.select_kernel(device, dtype, d, backend=backend)
        except Exception as error:  # noqa: BLE001 - a backend this machine lacks is reported, not fatal
            print(f"# {backend}: {error}")
            continue
        out, lse = kernel.forward(q, k, v, True, scale)
        for rank in args.ranks:
            calls = rank_calls(rank, args.cp)
            record = {"backend": backend, "kernel": kernel.name, "rank": rank, "cp": args.cp, "rows": rows,
                      "heads": heads, "kv_heads": kv_heads, "head_dim": d}
            record.update(_time_rank(kernel, calls, (q, k, v, out, lse, dout), scale, device, args.repeats))
            flops = 3.5 * 4 * rank_pairs(rank, args.cp, rows) * heads * d  # forward + 2.5x backward
            for name in ("kernels", "framework"):
                record[f"{name}_tflops"] = flops / (record[f"{name}_forward_ms"] + record[f"{name}_backward_ms"]) / 1e9
            record["ratio"] = ((record["framework_forward_ms"] + record["framework_backward_ms"])
                               / (record["kernels_forward_ms"] + record["kernels_backward_ms"]))
            records.append(record)
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=32768, help="local rows per rank (two round-robin chunks)")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32, help="torchtitan repeats the kv heads before SDPA")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backends", nargs="+", default=["torch", "cudnn"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq, args.heads, args.kv_heads, args.head_dim, args.repeats = 64, 4, 2, 16, 1
    records = bench(args)
    number = lambda x: f"{x:.1f}"  # noqa: E731
    emit(records, [("kernel", "kernel", str), ("rank", "rank", str), ("heads", "heads", str),
                   ("kernels_forward_ms", "kernels fwd ms", number), ("kernels_backward_ms", "bwd ms", number),
                   ("kernels_tflops", "TFLOP/s", number), ("framework_forward_ms", "framework fwd ms", number),
                   ("framework_backward_ms", "bwd ms", number), ("framework_tflops", "TFLOP/s", number),
                   ("ratio", "ratio", lambda x: f"{x:.3f}")])
    return records


if __name__ == "__main__":
    main()
