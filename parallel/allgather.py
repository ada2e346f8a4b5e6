"""All-gather context-parallel attention (Llama 3's): every rank attends its queries to the whole K/V.

K/V are gathered in kv-head chunks (the next chunk's all-gather runs while the current one computes),
put in sequence order and attended in one step of the plan's segments; the backward gathers them again
(nothing of the whole sequence is kept between forward and backward) and reduce-scatters dK/dV back
to their owners, each chunk's reduce-scatter running while the next chunk computes. K/V travel with
the kv heads they have (GQA makes them small).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parallel.attention_spec import AttentionSpec
from parallel.compat import all_gather_single, reduce_scatter_single
from parallel.cp_plan import CPPlan
from parallel.ring_comm import count_sent
from parallel.ring_core import accumulator_dtype, head_chunk_bounds, ring_backward, ring_forward


def _start_gather(k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int], group: dist.ProcessGroup):
    """Post the all-gather of k, v heads ``[h0, h1)``; returns (work, buffer [world, 2, B, n, h, D])."""
    mine = torch.stack([k[:, :, heads[0]:heads[1]], v[:, :, heads[0]:heads[1]]])
    world = dist.get_world_size(group)
    every = torch.empty((world * 2, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    count_sent("all_gather", mine, world - 1)
    work = all_gather_single(every, mine, group=group, async_op=True)
    return work, every.view(world, *mine.shape)


def _in_order(every: torch.Tensor, plan: CPPlan) -> torch.Tensor:
    """``[world, 2, B, n, h, D]`` gathered rank by rank -> ``[2, B', S', h, D]`` in the plan's sequence order."""
    world, two, batch, n = every.shape[:4]
    rows = every.permute(1, 2, 0, 3, 4, 5).reshape(two, batch, world * n, *every.shape[4:])
    if plan.packed:
        rows = rows.reshape(two, 1, batch * world * n, *every.shape[4:])
    return rows if plan.order is None else rows.index_select(2, plan.order.to(rows.device).flatten())


def _in_rank_order(grads: torch.Tensor, plan: CPPlan, world: int, batch: int) -> torch.Tensor:
    """The inverse of ``_in_order``: ``[2, B', S', h, D]`` -> ``[world * 2, B, n, h, D]`` for a reduce-scatter."""
    if plan.order is not None:
        order = plan.order.to(grads.device).flatten()
        back = torch.empty_like(grads)
        back.index_copy_(2, order, grads)
        grads = back
    grads = grads.reshape(2, batch, world, -1, *grads.shape[3:])
    return grads.permute(2, 0, 1, 3, 4, 5).reshape(world * 2, batch, -1, *grads.shape[4:]).contiguous()


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, spec: AttentionSpec, plan: CPPlan):
        batch, n, heads, dim = q.shape
        group_size = heads // k.shape[2]
        chunks = head_chunk_bounds(k.shape[2], spec.head_chunks)
        one = dataclasses.replace(spec, head_chunks=1)
        acc = accumulator_dtype(q.dtype)
        out = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
        lse = torch.empty(batch, n, heads, dtype=acc, device=q.device)
        pending = _start_gather(k, v, chunks[0], group)
        for index, (h0, h1) in enumerate(chunks):
            work, every = pending
            work.wait()
            pending = _start_gather(k, v, chunks[index + 1], group) if index + 1 < len(chunks) else None
            kv = _in_order(every, plan)
            qs = slice(h0 * group_size, h1 * group_size)
            out[:, :, qs], lse[:, :, qs] = ring_forward(q[:, :, qs], kv[0], kv[1], None, one, plan.ring)
            del every, kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.spec, ctx.plan = group, spec, plan
        lse = lse.transpose(1, 2)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, spec, plan = ctx.group, ctx.spec, ctx.plan
        world = dist.get_world_size(group)
        batch, n, heads, dim = q.shape
        group_size = heads // k.shape[2]
        chunks = head_chunk_bounds(k.shape[2], spec.head_chunks)
        one = dataclasses.replace(spec, head_chunks=1)
        dq = torch.empty(batch, n, heads, dim, dtype=accumulator_dtype(q.dtype), device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        pending, scattering = _start_gather(k, v, chunks[0], group), []
        for index, (h0, h1) in enumerate(chunks):
            work, every = pending
            work.wait()
            pending = _start_gather(k, v, chunks[index + 1], group) if index + 1 < len(chunks) else None
            kv = _in_order(every, plan)
            qs = slice(h0 * group_size, h1 * group_size)
            dq[:, :, qs], dk_all, dv_all = ring_backward(dout[:, :, qs], q[:, :, qs], kv[0], kv[1], out[:, :, qs],
                                                         lse[:, :, qs], None, one, plan.ring)
            del every, kv
            grads = _in_rank_order(torch.stack([dk_all, dv_all]), plan, world, batch)
            mine = torch.empty(2, batch, n, h1 - h0, dim, dtype=grads.dtype, device=grads.device)
            count_sent("reduce_scatter", grads, (world - 1) / world)
            scattering.append((reduce_scatter_single(mine, grads, group=group, async_op=True), mine, (h0, h1)))
            del grads, dk_all, dv_all
        for work, mine, (h0, h1) in scattering:
            work.wait()
            dk[:, :, h0:h1], dv[:, :, h0:h1] = mine[0], mine[1]
        return dq.to(q.dtype), dk, dv, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                        spec: AttentionSpec, plan: CPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, n, H, D] and lse [B, H, n] of this rank's queries against every rank's K/V."""
    return _AllGatherAttention.apply(q, k, v, group, spec, plan)
