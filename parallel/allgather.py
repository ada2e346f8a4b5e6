"""All-gather context-parallel attention (Llama 3's): every rank attends its queries to the whole K/V.

K/V are all-gathered in kv-head chunks and attended where they land, block by block in rank order
(``gathered_plan``: step 0 is the rank's own block, computed while the gather is in flight; the other
blocks follow, merged with the online softmax, while the next chunk's gather travels). Nothing is
reordered or copied. The backward gathers K/V again (nothing of the whole sequence is kept between
forward and backward), accumulates dK/dV per block in the gathered layout and reduce-scatters them back to
their owners, each chunk's reduce-scatter running while the next chunk computes. K/V travel with the kv
heads they have (GQA makes them small).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.attention_plan import RankPlan
from parallel.attention_spec import AttentionSpec
from parallel.compat import all_gather_single, reduce_scatter_single
from parallel.cp_plan import CPPlan
from parallel.ring_comm import count_sent
from parallel.ring_core import (
    accumulator_dtype,
    add_grad,
    forward_step,
    head_chunk_bounds,
    local_grads,
    plan_rows,
    step_grads,
)

Gather = tuple[list, torch.Tensor, torch.Tensor]  # (works, k blocks, v blocks [world, B, n, h, D])


def _start_gather(k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int], group: dist.ProcessGroup) -> Gather:
    """Post the all-gathers of kv heads ``[h0, h1)`` of k and v ``[B, n, Hk, D]``."""
    world = dist.get_world_size(group)
    works, blocks = [], []
    for x in (k, v):
        mine = x[:, :, heads[0]:heads[1]].contiguous()
        every = torch.empty((world * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        count_sent("all_gather", mine, world - 1)
        works.append(all_gather_single(every, mine, group=group, async_op=True))
        blocks.append(every.view(world, *mine.shape))
    return works, blocks[0], blocks[1]


def _landed(gather: Gather, plan: RankPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Wait for a chunk's gathers; its k and v blocks ``[world, B, n, h, D]`` (``[world, 1, B*n, h, D]`` packed)."""
    works, k_all, v_all = gather
    for work in works:
        work.wait()
    if plan.packed:
        k_all, v_all = (x.view(x.shape[0], 1, -1, *x.shape[3:]) for x in (k_all, v_all))
    return k_all, v_all


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, spec: AttentionSpec, plan: CPPlan):
        ring = plan.ring
        q_rows, k_rows, v_rows = plan_rows(q, ring), plan_rows(k, ring), plan_rows(v, ring)
        batch, n, heads, dim = q_rows.shape
        group_size = heads // k.shape[2]
        chunks = head_chunk_bounds(k.shape[2], spec.head_chunks)
        acc = accumulator_dtype(q.dtype)
        out = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
        lse = torch.empty(batch, n, heads, dtype=acc, device=q.device)
        pending = _start_gather(k, v, chunks[0], group)
        for index, (h0, h1) in enumerate(chunks):
            qs = slice(h0 * group_size, h1 * group_size)
            q_c, out_c, lse_c = q_rows[:, :, qs], out[:, :, qs], lse[:, :, qs]
            forward_step(ring, 0, q_c, [k_rows[:, :, h0:h1], v_rows[:, :, h0:h1]], out_c, lse_c, spec)
            k_all, v_all = _landed(pending, ring)
            pending = _start_gather(k, v, chunks[index + 1], group) if index + 1 < len(chunks) else None
            for step in range(1, ring.world):
                source = ring.steps[step].source
                forward_step(ring, step, q_c, [k_all[source], v_all[source]], out_c, lse_c, spec)
            del k_all, v_all
        out = out.view(q.shape).to(q.dtype)
        lse = lse.view(q.shape[:3])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.spec, ctx.plan = group, spec, plan
        lse = lse.transpose(1, 2)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        group, spec, ring = ctx.group, ctx.spec, ctx.plan.ring
        q, k, v, out, lse = ctx.saved_tensors
        dout, q_rows, k_rows, v_rows, out, lse = (plan_rows(x, ring) for x in (dout, q, k, v, out, lse))
        batch, n, heads, dim = q_rows.shape
        group_size = heads // k.shape[2]
        chunks = head_chunk_bounds(k.shape[2], spec.head_chunks)
        acc = accumulator_dtype(q.dtype)
        dq = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        pending, scattering = _start_gather(k, v, chunks[0], group), []
        for index, (h0, h1) in enumerate(chunks):
            qs = slice(h0 * group_size, h1 * group_size)
            rows = (dout[:, :, qs], q_rows[:, :, qs], out[:, :, qs], lse[:, :, qs])
            dq_c = dq[:, :, qs]
            # every block's dK/dV, in the gathered layout; the rank's own block first, while the gather travels
            grads_k, grads_v = (torch.empty((ring.world, batch, n, h1 - h0, dim), dtype=acc, device=q.device)
                                for _ in range(2))
            own = ring.rank
            for source in (s for s in range(ring.world) if s != own):
                grads_k[source].zero_()
                grads_v[source].zero_()
            local_grads(ring, rows, [k_rows[:, :, h0:h1], v_rows[:, :, h0:h1]], dq_c, grads_k[own], grads_v[own],
                        spec)
            k_all, v_all = _landed(pending, ring)
            pending = _start_gather(k, v, chunks[index + 1], group) if index + 1 < len(chunks) else None
            for step in range(1, ring.world):
                source = ring.steps[step].source
                for dk_b, dv_b, target in step_grads(ring, step, rows, [k_all[source], v_all[source]], dq_c, spec):
                    add_grad(grads_k[source], dk_b, target)
                    add_grad(grads_v[source], dv_b, target)
            del k_all, v_all
            for grads, target in ((grads_k, dk), (grads_v, dv)):
                mine = torch.empty((k.shape[0], k.shape[1], h1 - h0, dim), dtype=acc, device=q.device)
                grads = grads.view(ring.world * k.shape[0], k.shape[1], h1 - h0, dim)
                count_sent("reduce_scatter", grads, (ring.world - 1) / ring.world)
                scattering.append((reduce_scatter_single(mine, grads, group=group, async_op=True), mine,
                                   target[:, :, h0:h1], grads))
            del grads_k, grads_v
        for work, mine, target, _ in scattering:
            work.wait()
            target.copy_(mine)
        return dq.view(q.shape).to(q.dtype), dk, dv, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                        spec: AttentionSpec, plan: CPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, n, H, D] and lse [B, H, n] of this rank's queries against every rank's K/V."""
    return _AllGatherAttention.apply(q, k, v, group, spec, plan)
