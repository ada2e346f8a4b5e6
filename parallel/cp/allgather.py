"""All-gather context-parallel attention (Llama 3's): every rank attends its queries to the whole K/V.

K/V are all-gathered in kv-head chunks and attended where they land, block by block in rank order
(``gathered_plan``: step 0 is the rank's own block, computed while the gather is in flight; the other
blocks follow, merged with the online softmax, while the next chunk's gather travels). Nothing is
reordered or copied. The backward gathers K/V again (nothing of the whole sequence is kept between
forward and backward), accumulates dK/dV per block in the gathered layout and reduce-scatters them back to
their owners, each chunk's reduce-scatter running while the next chunk computes. K/V travel with the kv
heads they have (GQA makes them small).

With packed documents most rows of a block are used by no other rank: then (``not plan.whole_blocks``)
one all-to-all carries each rank just the rows it uses, compacted per source block, and another carries
their dK/dV back, added into the owner's rows; the compute is the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.compat import all_gather_single, reduce_scatter_single
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.plan.rank_plan import RankPlan
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.cp.ring.backward import add_grad, local_grads, step_grads, warm_backward
from cp_train.parallel.cp.ring.blocks import SavedRows
from cp_train.parallel.cp.ring.comm import count_sent
from cp_train.parallel.cp.ring.forward import (
    accumulator_dtype,
    forward_step,
    head_chunk_bounds,
    plan_rows,
    warm_forward,
)
from cp_train.parallel.cp.sinks import apply_sinks, sink_grad
from cp_train.parallel.cp.spec import AttentionSpec

Gather = tuple[list, list[torch.Tensor]]  # (works, [k, v] as they arrive)


def _routes(plan: RankPlan) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """The all-to-all of used rows: the index of the rows sent (``plan.send_index``, on the tensors' device
    with the plan), the rows sent to and received from each rank, and where each source's rows start in
    what arrives. Step ``t`` sends to rank ``rank + t`` and holds rank ``rank - t``'s."""
    world, rank = plan.world, plan.rank
    sent = [0 if d == rank else plan.steps[(d - rank) % world].kv_rows[0] for d in range(world)]
    received = [0 if s == rank else plan.steps[(rank - s) % world].held_rows for s in range(world)]
    starts = [sum(received[:source]) for source in range(world)]
    return plan.send_index, sent, received, starts


def _start_gather(k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int], group: dist.ProcessGroup,
                  plan: RankPlan) -> Gather:
    """Post the transfers of kv heads ``[h0, h1)`` of k and v (in the plan's rows ``[b, n, Hk, D]``): all-gathers
    of whole blocks, or the all-to-all of the rows each rank uses."""
    world = dist.get_world_size(group)
    works, arriving = [], []
    for x in (k, v):
        mine = x[:, :, heads[0]:heads[1]]
        if plan.whole_blocks:
            mine = mine.contiguous()
            every = torch.empty((world * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
            count_sent("all_gather", mine, world - 1)
            works.append(all_gather_single(every, mine, group=group, async_op=True))
        else:
            index, sent, received, _ = _routes(plan)
            rows_first = mine.transpose(0, 1).index_select(0, index)  # [rows, b, h, D]: all_to_all cuts dim 0
            every = torch.empty((sum(received), *rows_first.shape[1:]), dtype=x.dtype, device=x.device)
            count_sent("all_to_all", rows_first, 1)
            works.append(dist.all_to_all_single(every, rows_first, received, sent, group=group, async_op=True))
        arriving.append(every)
    return works, arriving


def _landed(gather: Gather, plan: RankPlan) -> list[list[torch.Tensor] | None]:
    """Wait for a chunk's transfers; per source rank its [k, v] store ``[b, rows, h, D]`` (None for this rank)."""
    works, arriving = gather
    for work in works:
        work.wait()
    others = [source for source in range(plan.world) if source != plan.rank]
    stores: list[list[torch.Tensor] | None] = [None] * plan.world
    if plan.whole_blocks:
        for source in others:
            stores[source] = [x.view(plan.world, -1, *x.shape[1:])[source] for x in arriving]
        return stores
    _, _, received, starts = _routes(plan)
    for source in others:
        rows = slice(starts[source], starts[source] + received[source])
        stores[source] = [x[rows].transpose(0, 1) for x in arriving]
    return stores


def _start_return(grads: list[list[torch.Tensor] | None], plan: RankPlan, group: dist.ProcessGroup,
                  like: torch.Tensor) -> list[tuple[object, torch.Tensor, torch.Tensor]]:
    """Post the all-to-alls carrying each source's [dk, dv] store (``grads[source]``) back to its owner: per
    tensor (work, what arrives ``[rows sent, b, h, D]`` in ``_routes``' index order, the buffer sent)."""
    index, sent, received, _ = _routes(plan)
    posted = []
    for which in range(2):
        parts = [grads[source][which].transpose(0, 1) for source in range(plan.world) if grads[source] is not None]
        outgoing = torch.cat(parts) if parts else like.new_zeros((0, *like.shape[:1], *like.shape[2:]))
        back = torch.empty((index.numel(), *outgoing.shape[1:]), dtype=outgoing.dtype, device=outgoing.device)
        count_sent("all_to_all", outgoing, 1)
        posted.append((dist.all_to_all_single(back, outgoing, sent, received, group=group, async_op=True), back,
                       outgoing))
    return posted


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, spec: AttentionSpec, plan: CPPlan, sinks=None):
        ring = plan.ring
        q_rows, k_rows, v_rows = plan_rows(q, ring), plan_rows(k, ring), plan_rows(v, ring)
        batch, n, heads, dim = q_rows.shape
        group_size = heads // k.shape[2]
        chunks = head_chunk_bounds(k.shape[2], spec.head_chunks)
        acc = accumulator_dtype(q.dtype)
        out = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
        lse = torch.empty(batch, n, heads, dtype=acc, device=q.device)
        pending = _start_gather(k_rows, v_rows, chunks[0], group, ring)
        for index, (h0, h1) in enumerate(chunks):
            qs = slice(h0 * group_size, h1 * group_size)
            q_c, out_c, lse_c = q_rows[:, :, qs], out[:, :, qs], lse[:, :, qs]
            own = [k_rows[:, :, h0:h1], v_rows[:, :, h0:h1]]
            if warm.needed(spec, q.shape[1], q_c, *own):  # the gathered blocks are shaped as received ones
                warm_forward(spec, q_c, own, ring.world, q.shape[1])
            forward_step(ring, 0, q_c, own, out_c, lse_c, spec)
            stores = _landed(pending, ring)
            pending = _start_gather(k_rows, v_rows, chunks[index + 1], group, ring) if index + 1 < len(chunks) else None
            for step in range(1, ring.world):
                forward_step(ring, step, q_c, stores[ring.steps[step].source], out_c, lse_c, spec)
            del stores
        if sinks is not None:
            apply_sinks(out, lse, sinks)
        out = out.view(q.shape).to(q.dtype)
        lse = lse.view(q.shape[:3])
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.group, ctx.spec, ctx.plan = group, spec, plan
        lse = lse.transpose(1, 2)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        group, spec, ring = ctx.group, ctx.spec, ctx.plan.ring
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        dsinks = sink_grad(dout, out, lse, sinks[0]) if sinks else None
        dout, q_rows, k_rows, v_rows, out, lse = (plan_rows(x, ring) for x in (dout, q, k, v, out, lse))
        batch, n, heads, dim = q_rows.shape
        group_size = heads // k.shape[2]
        chunks = head_chunk_bounds(k.shape[2], spec.head_chunks)
        acc = accumulator_dtype(q.dtype)
        dq = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
        dk, dv = (torch.empty(k_rows.shape, dtype=acc, device=q.device) for _ in range(2))
        gathers = ring.whole_blocks  # else used rows by all-to-all (see the module docstring)
        sent_rows = None if gathers else ring.send_index
        pending, returning = _start_gather(k_rows, v_rows, chunks[0], group, ring), []
        for index, (h0, h1) in enumerate(chunks):
            qs = slice(h0 * group_size, h1 * group_size)
            rows = SavedRows(dout[:, :, qs], q_rows[:, :, qs], out[:, :, qs], lse[:, :, qs])
            dq_c, dk_c, dv_c = dq[:, :, qs], dk[:, :, h0:h1], dv[:, :, h0:h1]
            # every block's dK/dV where it landed; the rank's own block first, while the gather travels
            grads: list[list[torch.Tensor] | None] = [None] * ring.world  # per source block: [dk, dv]
            if gathers:  # one buffer per tensor, every block in gathered order, for the reduce-scatter
                whole = [torch.empty((ring.world, batch, n, h1 - h0, dim), dtype=acc, device=q.device)
                         for _ in range(2)]
                grads = [[x[source] for x in whole] for source in range(ring.world)]
                own = grads[ring.rank]
            else:  # the rows each block's owner sent, compacted; the own block's grads go straight to dk, dv
                own = [dk_c, dv_c]
            for step in ring.steps[1:]:
                if grads[step.source] is None:
                    grads[step.source] = [torch.zeros((batch, step.held_rows, h1 - h0, dim), dtype=acc,
                                                      device=q.device) for _ in range(2)]
                else:
                    grads[step.source][0].zero_()
                    grads[step.source][1].zero_()
            local = [k_rows[:, :, h0:h1], v_rows[:, :, h0:h1]]
            if warm.needed(spec, q.shape[1], rows.dout, rows.q, rows.out, *local):
                for store in (local, [warm.received_like(x, q.shape[1]) for x in local]):
                    warm_backward(spec, rows, store, ring.world, q.shape[1])
            local_grads(ring, rows, local, dq_c, own[0], own[1], spec)
            stores = _landed(pending, ring)
            pending = _start_gather(k_rows, v_rows, chunks[index + 1], group, ring) if index + 1 < len(chunks) else None
            for step in range(1, ring.world):
                source = ring.steps[step].source
                for grad in step_grads(ring, step, rows, stores[source], dq_c, spec):
                    add_grad(grads[source][0], grad.dk, grad.target)
                    add_grad(grads[source][1], grad.dv, grad.target)
            del stores
            if gathers:
                for grad, target in zip(whole, (dk_c, dv_c), strict=True):
                    mine = torch.empty(target.shape, dtype=acc, device=q.device)
                    flat = grad.view(ring.world * batch, *grad.shape[2:])
                    count_sent("reduce_scatter", flat, (ring.world - 1) / ring.world)
                    returning.append((reduce_scatter_single(mine, flat, group=group, async_op=True), mine, flat,
                                      target))
            else:
                returning.extend((*posted, target)
                                 for posted, target in zip(_start_return(grads, ring, group, dk_c), (dk_c, dv_c),
                                                           strict=True))
            del grads
        for work, arrived, _sent, target in returning:  # the buffer sent stays alive until its work is done
            work.wait()
            if sent_rows is None:
                target.copy_(arrived)
            else:  # a row sent to several ranks gets each one's share
                target.index_add_(1, sent_rows, arrived.transpose(0, 1))
        dk, dv = (x.view(k.shape).to(k.dtype) for x in (dk, dv))
        return dq.view(q.shape).to(q.dtype), dk, dv, None, None, None, dsinks


def allgather_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   spec: AttentionSpec, plan: CPPlan, sinks: torch.Tensor | None = None
                   ) -> tuple[type[torch.autograd.Function], tuple]:
    """The autograd Function of the all-gather algorithm (also the ring's halo exchange: ``CPPlan.halo``) and its
    ``apply`` arguments. ``plan``'s index tensors are read on q's device (moved ahead by ``CPPlan.to``; else
    moved once here)."""
    return _AllGatherAttention, (q, k, v, group, spec, plan.on_device(q.device), sinks)

