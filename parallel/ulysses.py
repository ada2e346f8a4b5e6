"""Ulysses and hybrid (Ulysses x ring) context-parallel attention.

An all-to-all over the Ulysses group turns this rank's ``n`` tokens of every head into every group
member's tokens (``u * n``) of ``H / u`` heads; the tokens are put in sequence order, attended (the
whole sequence for ``ulysses``; the ring across the Ulysses groups for ``hybrid``), put back in rank
order, and a second all-to-all returns each rank its own tokens of every head. With fewer kv heads than
``u`` each kv head is repeated just enough for every rank to hold one (its gradient sums back).
Autograd runs through the all-to-alls (each one's backward is the other).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.attention_spec import AttentionSpec, CPGroups
from parallel.cp_plan import CPPlan
from parallel.ring_attention import ring_attention
from parallel.ring_comm import count_sent


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, n, H, D]`` (this rank's tokens) -> ``[B, u*n, H/u, D]`` (the group's tokens, rank by rank)."""
    u = dist.get_world_size(group)
    batch, n, heads, dim = x.shape
    send = x.reshape(batch, n, u, heads // u, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    count_sent("all_to_all", send, (u - 1) / u)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(batch, u * n, heads // u, dim)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``: ``[B, u*n, h, D]`` -> ``[B, n, u*h, D]``."""
    u = dist.get_world_size(group)
    batch, rows, heads, dim = x.shape
    send = x.reshape(batch, u, rows // u, heads, dim).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    count_sent("all_to_all", send, (u - 1) / u)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, rows // u, u * heads, dim)


class _AllToAll(torch.autograd.Function):
    """``_seq_to_heads`` (``to_heads``) or ``_heads_to_seq``, with the other as its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
        return back, None, None


def _reorder(x: torch.Tensor, order: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """Rows of ``x`` [B, rows, ...] in ``order`` (per sample, or of the folded batch when ``packed``)."""
    if packed:
        x = x.reshape(1, -1, *x.shape[2:])
    return x if order is None else x.index_select(1, order.to(x.device).flatten())


def _restore(x: torch.Tensor, order: torch.Tensor | None, batch: int) -> torch.Tensor:
    """The inverse of ``_reorder``: back to rank order and ``batch`` samples."""
    if order is not None:
        inverse = torch.empty_like(order.flatten())
        inverse[order.flatten()] = torch.arange(inverse.numel())
        x = x.index_select(1, inverse.to(x.device))
    return x.reshape(batch, -1, *x.shape[2:])


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: CPGroups, spec: AttentionSpec,
                      plan: CPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, n, H, D] and lse [B, H, n] of this rank's tokens (the hybrid form when ``groups.ring`` is set)."""
    group = groups.ulysses if spec.algorithm == "hybrid" else groups.cp
    u = dist.get_world_size(group)
    if k.shape[2] < u:  # every rank needs a kv head: repeat each just enough
        k, v = (x.repeat_interleave(u // k.shape[2], dim=2) for x in (k, v))
    batch = q.shape[0]
    q, k, v = (_reorder(_AllToAll.apply(x, group, True), plan.order, plan.packed) for x in (q, k, v))
    ring_group = groups.ring if spec.algorithm == "hybrid" else None
    out, lse = ring_attention(q, k, v, ring_group, spec, plan.ring)
    out = _AllToAll.apply(_restore(out, plan.order, batch), group, False)
    with torch.no_grad():  # the lse travels back like a head_dim of one
        lse = _heads_to_seq(_restore(lse.transpose(1, 2).unsqueeze(-1), plan.order, batch), group)
    return out, lse.squeeze(-1).transpose(1, 2)
