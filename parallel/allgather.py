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


def _start_gather(x: torch.Tensor, heads: tuple[int, int], group: dist.ProcessGroup):
    """Post the all-gather of heads ``[h0, h1)`` of ``x`` [B, n, Hk, D]; returns (work, buffer [world, B, n, h, D])."""
    mine = x[:, :, heads[0]:heads[1]].contiguous()
    world = dist.get_world_size(group)
    every = torch.empty((world * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    count_sent("all_gather", mine, world - 1)
    work = all_gather_single(every, mine, group=group, async_op=True)
    return work, every.view(world, *mine.shape)


def _start_gathers(k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int], group: dist.ProcessGroup):
    return [_start_gather(x, heads, group) for x in (k, v)]


def _sources(plan: CPPlan, world: int, batch: int, n: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank, sample, row) ``[B', S']`` in the gathered ``[world, B, n]`` of each key in sequence order (the
    folded batch ``[1, B*world*n]`` when the plan is packed); cached in the plan."""
    key = ("allgather", world, batch, n, str(device))
    if key not in plan.cache:
        total = world * n * (batch if plan.packed else 1)
        position = plan.order.flatten() if plan.order is not None else torch.arange(total)
        rank, row = (position // n) % world, position % n
        sample = (position // (world * n))[None] if plan.packed else torch.arange(batch)[:, None]
        plan.cache[key] = tuple(x.to(device) for x in (rank[None], sample, row[None]))  # broadcast to [B', S']
    return plan.cache[key]


def _in_order(every: torch.Tensor, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``[world, B, n, h, D]`` gathered rank by rank -> ``[B', S', h, D]`` in the plan's sequence order (one copy)."""
    return every[sources]


def _in_rank_order(grads: torch.Tensor, sources: tuple[torch.Tensor, ...], world: int, batch: int,
                   n: int) -> torch.Tensor:
    """The inverse of ``_in_order``: ``[B', S', h, D]`` -> ``[world * B, n, h, D]`` for a reduce-scatter."""
    back = torch.empty((world, batch, n, *grads.shape[2:]), dtype=grads.dtype, device=grads.device)
    back[sources] = grads
    return back.view(world * batch, n, *grads.shape[2:])


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
        sources = _sources(plan, dist.get_world_size(group), batch, n, q.device)
        pending = _start_gathers(k, v, chunks[0], group)
        for index, (h0, h1) in enumerate(chunks):
            for work, _ in pending:
                work.wait()
            k_all, v_all = (_in_order(every, sources) for _, every in pending)
            pending = _start_gathers(k, v, chunks[index + 1], group) if index + 1 < len(chunks) else []
            qs = slice(h0 * group_size, h1 * group_size)
            out[:, :, qs], lse[:, :, qs] = ring_forward(q[:, :, qs], k_all, v_all, None, one, plan.ring)
            del k_all, v_all
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
        sources = _sources(plan, world, batch, n, q.device)
        pending, scattering = _start_gathers(k, v, chunks[0], group), []
        for index, (h0, h1) in enumerate(chunks):
            for work, _ in pending:
                work.wait()
            k_all, v_all = (_in_order(every, sources) for _, every in pending)
            pending = _start_gathers(k, v, chunks[index + 1], group) if index + 1 < len(chunks) else []
            qs = slice(h0 * group_size, h1 * group_size)
            dq[:, :, qs], dk_all, dv_all = ring_backward(dout[:, :, qs], q[:, :, qs], k_all, v_all, out[:, :, qs],
                                                         lse[:, :, qs], None, one, plan.ring)
            del k_all, v_all
            for grad_all, target in ((dk_all, dk), (dv_all, dv)):
                grads = _in_rank_order(grad_all, sources, world, batch, n)
                mine = torch.empty(batch, n, h1 - h0, dim, dtype=grads.dtype, device=grads.device)
                count_sent("reduce_scatter", grads, (world - 1) / world)
                scattering.append((reduce_scatter_single(mine, grads, group=group, async_op=True), mine,
                                   target[:, :, h0:h1]))
            del grads, dk_all, dv_all
        for work, mine, target in scattering:
            work.wait()
            target.copy_(mine)
        return dq.to(q.dtype), dk, dv, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                        spec: AttentionSpec, plan: CPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, n, H, D] and lse [B, H, n] of this rank's queries against every rank's K/V."""
    return _AllGatherAttention.apply(q, k, v, group, spec, plan)
