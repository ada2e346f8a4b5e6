"""The attention kernel contract: what every kernel ``select_kernel`` returns takes and gives back.

- ``kernel.forward(q, k, v, causal, scale) -> (out, lse)``
- ``kernel.backward(rows, k, v, causal, scale) -> (dq, dk, dv)``, ``rows`` a ``BackwardRows``
- ``kernel.varlen_forward(q, k, v, segments, causal, scale) -> (out, lse)``, ``segments`` a ``VarlenSegments``
- ``kernel.varlen_backward(rows, k, v, segments, causal, scale) -> (dq, dk, dv)``
- ``kernel.native_varlen``: whether the varlen calls are the kernel's own (a GPU kernel) or dense calls per
  segment (``varlen.VarlenBySegments``: the ring then runs those steps' dense calls on views, gathering nothing)

Dense calls: q, out, dout ``[B, Sq, H, D]``; k, v ``[B, Sk, Hk, D]`` (flash-attn's layout; row-sliced views
are fine); lse ``[B, H, Sq]``. Varlen calls: q, out, dout ``[Tq, H, D]``; k, v ``[Tk, Hk, D]``; lse ``[H, Tq]``;
segment ``i`` of ``segments`` is query rows ``cu_q[i]:cu_q[i+1]`` against key rows ``cu_k[i]:cu_k[i+1]``.
k and v may have fewer heads than q (GQA: ``H % Hk == 0``). lse is float32 (float64 for float64 inputs),
natural log, scale included. Dense causal masks are only used on square blocks, where every backend agrees
(the fused backends raise ``ValueError`` for a rectangular causal call: ``check_square_causal``);
varlen causal masks are aligned bottom-right (query ``t`` of a segment of ``R`` rows and ``K`` keys sees the
first ``K - R + t + 1`` keys), as flash-attn's. The backwards, given the *final* merged ``out``/``lse`` of
the query rows, return this K/V block's exact share of dq and its exact dk/dv (dq like q, dk/dv like k/v).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

OutLse = tuple[torch.Tensor, torch.Tensor]  # (out, lse) of a forward
QKVGrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (dq, dk, dv) of a backward



def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32, or float64 for float64 inputs (the dtype of lse and of merged outputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32

class VarlenSegments(NamedTuple):
    """The packed segments of one varlen call: ``cu_q``/``cu_k`` int32 ``[segments + 1]`` cumulative row
    offsets into q and k/v (on their device), ``max_q``/``max_k`` the longest segment's query and key rows."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class BackwardRows(NamedTuple):
    """The query rows' tensors a backward takes: ``dout``, ``q``, the forward's final ``out`` (all
    ``[B, Sq, H, D]`` dense, ``[Tq, H, D]`` varlen) and its final ``lse`` (``[B, H, Sq]`` dense, ``[H, Tq]``
    varlen)."""

    dout: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def check_square_causal(name: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """ValueError unless a dense causal call is square (q ``[B, Sq, ...]``, k ``[B, Sk, ...]``): the kernels
    align a rectangular causal mask differently (top-left or bottom-right), so none is accepted."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"{name}: a dense causal block must be square, got {q.shape[1]} query rows and "
                         f"{k.shape[1]} key rows; split it into a non-causal part and a square causal part "
                         f"(as varlen.py's by-segment calls do) or use a varlen call")


class AttentionKernel(Protocol):
    """One backend's attention (see the module docstring for shapes and masks)."""

    name: str
    native_varlen: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> OutLse: ...

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> QKVGrads: ...

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse: ...

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads: ...
