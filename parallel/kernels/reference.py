"""The float64 reference kernel (``MathKernel``, backend ``math``): attention that materialises the scores.

The tests' reference and the CUDA float64 path; the admission trial (``trial.py``) compares a fused kernel's
results with it. The contract's shapes and masks (``contract.py``); causal masks aligned top-left, which on the
square blocks the dense calls allow is every backend's alignment.
"""

from __future__ import annotations

import torch

from cp_train.parallel.kernels.contract import BackwardRows, OutLse, QKVGrads
from cp_train.parallel.kernels.torch_ops import expand_kv, reduce_kv_grad
from cp_train.parallel.kernels.varlen import VarlenBySegments


class MathKernel(VarlenBySegments):
    """float64 attention that materialises the scores (the tests' reference; any device)."""

    name = "math"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> OutLse:
        scores = _math_scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, expand_kv(v, q.shape[2]).double())
        return out, lse.masked_fill(torch.isinf(lse), 0.0)

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> QKVGrads:
        """The contract's backward in float64: this block's share of the gradient of the softmax whose final
        ``rows.out`` and ``rows.lse`` are given (they span every block of the rows' keys, as in a ring step);
        None for both: this block holds all the keys (its own forward supplies them)."""
        if rows.out is None or rows.lse is None:
            rows = rows._replace(**dict(zip(("out", "lse"), self.forward(rows.q, k, v, causal, scale), strict=True)))
        dout, q, out, lse = (t.double() for t in rows)
        heads = q.shape[2]
        k64, v64 = expand_kv(k, heads).double(), expand_kv(v, heads).double()
        probs = torch.exp(_math_scores(q, k, causal, scale) - lse[..., None])  # [B, H, Sq, Sk]
        delta = (dout * out).sum(-1).transpose(1, 2)  # [B, H, Sq]
        dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", dout, v64) - delta[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k64) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout)
        return dq, reduce_kv_grad(dk, k.shape[2]), reduce_kv_grad(dv, k.shape[2])


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """float64 scores [B, H, Sq, Sk] with the causal mask aligned top-left (query i sees keys j <= i)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), expand_kv(k, q.shape[2]).double()) * scale
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores
