"""Variable-length ("varlen") attention calls: many (query, key) segments packed into one call.

The call forms, shapes and masks are the kernel contract's (``contract.py``: ``kernel.varlen_forward(q, k, v,
segments, causal, scale)``, ``kernel.varlen_backward(rows, k, v, segments, causal, scale)``). Kernels without
a varlen form (the CPU flash kernel, the float64 reference) run each segment as dense calls (``by_segments``);
the GPU kernels call their own varlen entry points. Some of those keep the lse padded per segment
(``[segments, H, rows]``): ``lse_to_padded`` / ``lse_from_padded`` convert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_train.parallel.kernels.contract import (
    AttentionKernel,
    BackwardRows,
    OutLse,
    QKVGrads,
    VarlenSegments,
    accumulator_dtype,
)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out [..., m, h, D], lse [..., m, h]) into the running (out, lse), in place, in fp32:
    ``out -= sigmoid(block_lse - lse) * (out - block_out)``, ``lse -= logsigmoid(lse - block_lse)``."""
    block_lse = block_lse.to(lse.dtype)
    weight = torch.sigmoid(block_lse - lse)
    lse.sub_(F.logsigmoid(lse - block_lse))
    out.lerp_(block_out.to(out.dtype), weight.unsqueeze(-1))


def _bounds(cu: torch.Tensor) -> list[int]:
    return [int(x) for x in cu.tolist()]


def _dense_parts(rows: int, keys: int, causal: bool) -> list[tuple[int, int, bool]]:
    """A segment as dense calls with square causal masks: (key start, key stop, causal) in segment rows."""
    if not causal or keys == rows:
        return [(0, keys, causal)]
    return [(0, keys - rows, False), (keys - rows, keys, True)]


def forward_by_segments(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        segments: VarlenSegments, causal: bool, scale: float) -> OutLse:
    """The varlen forward as one dense ``kernel.forward`` call per segment part (merged in fp32)."""
    bq, bk = _bounds(segments.cu_q), _bounds(segments.cu_k)
    out = torch.empty(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=out.dtype, device=q.device)
    for i in range(len(bq) - 1):
        rows, keys = slice(bq[i], bq[i + 1]), (bk[i], bk[i + 1])
        for number, (k0, k1, part_causal) in enumerate(_dense_parts(rows.stop - rows.start, keys[1] - keys[0],
                                                                    causal)):
            part_out, part_lse = kernel.forward(q[None, rows], k[None, keys[0] + k0: keys[0] + k1],
                                                v[None, keys[0] + k0: keys[0] + k1], part_causal, scale)
            if number == 0:
                out[rows] = part_out[0]
                lse[rows] = part_lse[0].transpose(0, 1)
            else:
                merge_block(out[rows], lse[rows], part_out[0], part_lse[0].transpose(0, 1))
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def backward_by_segments(kernel: AttentionKernel, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor,
                         segments: VarlenSegments, causal: bool, scale: float) -> QKVGrads:
    """The varlen backward as dense ``kernel.backward`` calls per segment part (each given the final lse)."""
    dout, q, out, lse = rows
    bq, bk = _bounds(segments.cu_q), _bounds(segments.cu_k)
    acc = accumulator_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for i in range(len(bq) - 1):
        part, start = slice(bq[i], bq[i + 1]), bk[i]
        for k0, k1, part_causal in _dense_parts(part.stop - part.start, bk[i + 1] - start, causal):
            keys = slice(start + k0, start + k1)
            gq, gk, gv = kernel.backward(
                BackwardRows(dout[None, part], q[None, part], out[None, part], lse[None, :, part]),
                k[None, keys], v[None, keys], part_causal, scale)
            dq[part] += gq[0]
            dk[keys] += gk[0]
            dv[keys] += gv[0]
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def padded_index(cu_q: torch.Tensor, rows: int, total: int) -> torch.Tensor:
    """For each of the ``total`` packed query tokens, its place in a ``[segments * rows]`` padded layout."""
    tokens = torch.arange(total, device=cu_q.device)
    starts = cu_q.to(torch.int64)
    segment = torch.searchsorted(starts, tokens, right=True) - 1
    return segment * rows + (tokens - starts[segment])


def lse_from_padded(padded: torch.Tensor, cu_q: torch.Tensor, total: int) -> torch.Tensor:
    """``[segments, H, rows]`` (padded per segment) -> ``[H, total]``."""
    segments, heads, rows = padded.shape
    flat = padded.transpose(0, 1).reshape(heads, segments * rows)
    return flat.index_select(1, padded_index(cu_q, rows, total))


def lse_to_padded(lse: torch.Tensor, cu_q: torch.Tensor, rows: int) -> torch.Tensor:
    """``[H, Tq]`` -> a dense ``[segments, H, rows]`` (padding rows 0)."""
    heads, segments = lse.shape[0], cu_q.shape[0] - 1
    flat = lse.new_zeros(heads, segments * rows)
    flat.index_copy_(1, padded_index(cu_q, rows, lse.shape[1]), lse)
    return flat.view(heads, segments, rows).transpose(0, 1).contiguous()


class VarlenBySegments:
    """The varlen calls of a kernel without a varlen entry of its own (the CPU flash kernel, the float64
    reference): each segment as one dense ``forward``/``backward`` call of the kernel."""

    native_varlen = False  # the ring runs such a kernel's varlen steps as dense calls on views (no gathers)

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse:
        return forward_by_segments(self, q, k, v, segments, causal, scale)

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads:
        return backward_by_segments(self, rows, k, v, segments, causal, scale)
