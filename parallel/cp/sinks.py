"""Learned attention sinks (gpt-oss, granite_swa): one logit per query head that joins every softmax's
denominator and has no value.

Applied once per query row, after the whole merge of the row's blocks (never per ring step, which would
scale the output by sigmoid^P): ``lse' = logaddexp(lse, s_h)``, ``out' = out * sigmoid(lse - s_h)``. The
algorithms save ``(out', lse')``, so every block's unchanged backward is exact; the one new gradient is
``dsink_h = -sum_i exp(s_h - lse'_i) * sum_d dO_id out'_id`` over this rank's rows. Each rank returns its own
rows' share; the trainer's gradient sum over DP x CP adds the shares (as for every other parameter).
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, heads: int, dtype: torch.dtype) -> None:
    """``ValueError`` (one line) unless ``sinks`` is None or a float ``[heads]`` tensor of fp32 or ``dtype``."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a [heads] = [{heads}] tensor (one logit per query head), got {shape}")
    if sinks.dtype not in (torch.float32, dtype, torch.float64):
        raise ValueError(f"sinks have dtype {sinks.dtype}; pass them in float32 or q's dtype ({dtype})")


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """In place: out ``[..., h, D]`` and lse ``[..., h]`` (views are fine) of the rows' merged attention over
    heads whose sink logits are ``sinks`` ``[h]`` become ``out * sigmoid(lse - s)`` and ``logaddexp(lse, s)``."""
    s = sinks.detach().to(lse.dtype)
    scale = torch.sigmoid(lse - s)
    out.mul_(scale.unsqueeze(-1).to(out.dtype))
    lse.copy_(torch.logaddexp(lse, s))


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """dsinks ``[h]`` (``sinks``' dtype) of this rank's rows: dout, out ``[..., h, D]`` (the final ``out'``),
    lse ``[..., h]`` (the final ``lse'``). Summed in float64: a sum over every row whose terms cancel
    (O(rows x heads x head_dim) work, small beside the attention's)."""
    acc = torch.float64
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    weight = torch.exp(sinks.detach().to(acc) - lse.to(acc))
    return -(weight * delta).flatten(0, -2).sum(0).to(sinks.dtype)
