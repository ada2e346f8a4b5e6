"""Ulysses attention over packed documents: home documents stay, only cross rows take the all-to-all.

Plan: ``cp_train.parallel.cp.plan.ulysses_plan.UlyssesDocuments``. Per call:

- the first head chunk's cross rows of q, k, v leave (an all-to-all with uneven splits: rank ``j``
  sends its ``counts[j]`` cross rows of the receiver's heads);
- meanwhile this rank attends its home documents with all heads, straight into ``out`` / the gradients;
- per head chunk, every received block of cross queries attends every received cross K/V block where it
  landed; the results return by the inverse all-to-all while the next chunk computes, and land in the
  cross rows.

Shapes: q, out ``[B, n, H, D]``; k, v ``[B, n, Hk, D]`` (``Hk`` a multiple of the group size); lse returned
``[B, H, n]`` (float32 accumulator). Tensors are viewed as the plan's rows (``[1, B*n, ...]`` when packed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.plan.device import Selector
from cp_train.parallel.cp.plan.ulysses_plan import UlyssesDocuments
from cp_train.parallel.cp.ring.backward import add_grad, local_grads, step_grads
from cp_train.parallel.cp.ring.blocks import SavedRows
from cp_train.parallel.cp.ring.comm import BYTES_SENT
from cp_train.parallel.cp.ring.forward import forward_step, plan_rows
from cp_train.parallel.cp.sinks import apply_sinks, sink_grad
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import accumulator_dtype

Pending = tuple[object, Callable[[], torch.Tensor]]  # (work, the result once it completed)


def _post_to_heads(x: torch.Tensor, rows: Selector, docs: UlyssesDocuments, group: dist.ProcessGroup
                   ) -> tuple[object, list[torch.Tensor]]:
    """Start sending this rank's cross ``rows`` (on ``x``'s device) of ``x`` ``[B, n, h, D]`` (h over the ``u``
    ranks) to their head owners; the result is every rank's cross rows of this rank's ``h / u`` heads, one
    block per rank."""
    u = len(docs.counts)
    batch, _, heads, dim = x.shape
    split = x.unflatten(2, (u, heads // u)).permute(2, 0, 1, 3, 4)  # [u, B, n, h/u, D], a view
    send = split[:, :, rows].contiguous() if isinstance(rows, slice) else split.index_select(2, rows)
    sizes = [batch * count * (heads // u) * dim for count in docs.counts]
    recv = torch.empty(sum(sizes), dtype=x.dtype, device=x.device)
    BYTES_SENT["all_to_all"] += (send.numel() // u) * (u - 1) * send.element_size()
    work = dist.all_to_all_single(recv, send.flatten(), sizes, [send.numel() // u] * u, group=group, async_op=True)
    blocks = [part.view(batch, count, heads // u, dim) for part, count in zip(recv.split(sizes), docs.counts,
                                                                                strict=True)]
    return work, blocks


def _post_home(flat: torch.Tensor, shapes: list[tuple[int, ...]], rank: int, group: dist.ProcessGroup) -> Pending:
    """Start returning ``flat`` (every rank's block of results, rank after rank, ``shapes``) to the blocks'
    owners; the result is ``[B, rows, u * h, ...]``: this rank's cross rows with every rank's heads."""
    u = len(shapes)
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    own = shapes[rank]
    recv = torch.empty(u * sizes[rank], dtype=flat.dtype, device=flat.device)
    BYTES_SENT["all_to_all"] += (flat.numel() - sizes[rank]) * flat.element_size()
    work = dist.all_to_all_single(recv, flat, [sizes[rank]] * u, sizes, group=group, async_op=True)
    return work, lambda: recv.view(u, *own).movedim(0, 2).flatten(2, 3)


def _put(target: torch.Tensor, rows: Selector, value: torch.Tensor) -> None:
    """``target[:, rows] = value`` for a slice or an index tensor of rows (on ``target``'s device)."""
    if isinstance(rows, slice):
        target[:, rows] = value
    else:
        target.index_copy_(1, rows, value.to(target.dtype))


def _flat_blocks(counts: tuple[int, ...], batch: int, tail: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, zero: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat buffer and its views ``[batch, counts[i], *tail]``, block after block."""
    shapes = [(batch, count, *tail) for count in counts]
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    flat = (torch.zeros if zero else torch.empty)(sum(sizes), dtype=dtype, device=device)
    return flat, [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


def _land(back: list[tuple[tuple[slice, ...], list[Pending]]], targets: tuple[torch.Tensor, ...],
          rows: Selector) -> None:
    """Write each head chunk's returning results into its heads of ``targets``' cross ``rows``."""
    for heads, pendings in back:
        for target, heads_of, (work, result) in zip(targets, heads, pendings, strict=True):
            work.wait()
            _put(target[:, :, heads_of], rows, result())


def _unflatten(flat: list[torch.Tensor], layout: list[list[int]]) -> list[list[list[torch.Tensor]]]:
    """Per chunk, its (q, k, v, out, lse) block lists, cut from ``flat`` by ``layout``'s list lengths."""
    out, at = [], 0
    for chunk in layout:
        parts = []
        for length in chunk:
            parts.append(flat[at:at + length])
            at += length
        out.append(parts)
    return out


class UlyssesDocumentsAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, spec: AttentionSpec, plan: CPPlan, chunks: int, sinks=None):
        docs: UlyssesDocuments = plan.documents
        u, rank = len(docs.counts), dist.get_rank(group)
        shape, kv_shape = q.shape, k.shape
        q, k, v = (plan_rows(x, plan) for x in (q, k, v))
        batch, rows, heads, dim = q.shape
        q_step, kv_step = heads // chunks, k.shape[2] // chunks
        acc = accumulator_dtype(q.dtype)
        travels = sum(docs.counts) > 0
        cross = docs.cross  # on q's device with the plan (``CPPlan.to``)

        def post(c: int) -> list[tuple[object, list[torch.Tensor]]]:
            return [_post_to_heads(x[:, :, c * w:(c + 1) * w], cross, docs, group)
                    for x, w in ((q, q_step), (k, kv_step), (v, kv_step))]

        out = torch.empty(batch, rows, heads, dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, rows, heads, dtype=acc, device=q.device)
        pending = post(0) if travels else []
        if docs.home is not None:  # while the first chunk travels
            forward_step(docs.home, 0, q, [k, v], out, lse, spec)
            if sinks is not None:  # every row here (the cross rows are overwritten when they land)
                apply_sinks(out, lse, sinks)
        saved, back = [], []
        for c in range(chunks if travels else 0):
            for work, _ in pending:
                work.wait()
            (_, q_b), (_, k_b), (_, v_b) = pending
            pending = post(c + 1) if c + 1 < chunks else []
            tail = (q_step // u, dim)
            out_flat, out_b = _flat_blocks(docs.counts, batch, tail, acc, q.device)
            lse_flat, lse_b = _flat_blocks(docs.counts, batch, tail[:1], acc, q.device)
            for i, block in enumerate(docs.blocks):
                for index, step in enumerate(block.steps):
                    forward_step(block, index, q_b[i], [k_b[step.source], v_b[step.source]], out_b[i], lse_b[i],
                                 spec)
            if sinks is not None:  # this rank's heads of the chunk, on every block (one flat buffer)
                first = c * q_step + rank * (q_step // u)
                for o, s in zip(out_b, lse_b, strict=True):
                    apply_sinks(o, s, sinks[first:first + q_step // u])
            out_flat = out_flat.to(q.dtype)
            out_b = [part.view(o.shape) for part, o in zip(out_flat.split([o.numel() for o in out_b]), out_b,
                                                             strict=True)]
            saved.append((q_b, k_b, v_b, out_b, lse_b))
            shapes = [tuple(o.shape) for o in out_b]
            back.append(((slice(c * q_step, (c + 1) * q_step),) * 2,
                         [_post_home(out_flat, shapes, rank, group),
                          _post_home(lse_flat, [s[:3] for s in shapes], rank, group)]))
        _land(back, (out, lse), cross)
        # the received blocks go through save_for_backward too, so that checkpointing frees them with the rest
        ctx.layout = [[len(part) for part in chunk] for chunk in saved]
        ctx.sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *(x for chunk in saved for part in chunk for x in part),
                              *(() if sinks is None else (sinks,)))
        ctx.group, ctx.spec, ctx.plan, ctx.chunks, ctx.shapes = group, spec, plan, chunks, (shape, kv_shape)
        lse = lse.view(*shape[:3]).transpose(1, 2)
        ctx.mark_non_differentiable(lse)
        return (out.view(shape) if plan.packed else out), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        group, spec, plan, chunks = ctx.group, ctx.spec, ctx.plan, ctx.chunks
        docs: UlyssesDocuments = plan.documents
        u, rank = len(docs.counts), dist.get_rank(group)
        q, k, v, out, lse, *flat = ctx.saved_tensors
        sinks = flat.pop() if ctx.sinks else None
        dsinks = None if sinks is None else sink_grad(plan_rows(dout, plan), out, lse, sinks)
        received = _unflatten(flat, ctx.layout)
        q_shape, kv_shape = ctx.shapes
        dout = plan_rows(dout, plan)
        batch, rows, heads, dim = q.shape
        kv_heads = k.shape[2]
        q_step, kv_step = heads // chunks, kv_heads // chunks
        acc = accumulator_dtype(dout.dtype)
        # every row is a home row (local_grads writes it) or a cross row (landed from the all-to-all)
        dq = torch.empty(batch, rows, heads, dim, dtype=dout.dtype, device=dout.device)
        dk = torch.empty(batch, rows, kv_heads, dim, dtype=dout.dtype, device=dout.device)
        dv = torch.empty_like(dk)
        travels = sum(docs.counts) > 0
        cross = docs.cross

        def post(c: int) -> tuple[object, list[torch.Tensor]]:
            return _post_to_heads(dout[:, :, c * q_step:(c + 1) * q_step], cross, docs, group)

        pending = post(0) if travels else None
        if docs.home is not None:
            local_grads(docs.home, SavedRows(dout, q, out, lse), [k, v], dq, dk, dv, spec)
        back = []
        for c in range(chunks if travels else 0):
            pending[0].wait()
            dout_b = pending[1]
            pending = post(c + 1) if c + 1 < chunks else None
            q_b, k_b, v_b, out_b, lse_b = received[c]
            dq_flat, dq_b = _flat_blocks(docs.counts, batch, (q_step // u, dim), acc, dout.device)
            dk_flat, dk_b = _flat_blocks(docs.counts, batch, (kv_step // u, dim), acc, dout.device, zero=True)
            dv_flat, dv_b = _flat_blocks(docs.counts, batch, (kv_step // u, dim), acc, dout.device, zero=True)
            for i, block in enumerate(docs.blocks):
                dq_b[i].zero_()
                block_rows = SavedRows(dout_b[i], q_b[i], out_b[i], lse_b[i])
                for index, step in enumerate(block.steps):
                    held = [k_b[step.source], v_b[step.source]]
                    for grad in step_grads(block, index, block_rows, held, dq_b[i], spec):
                        add_grad(dk_b[step.source], grad.dk, grad.target)
                        add_grad(dv_b[step.source], grad.dv, grad.target)
            q_shapes = [tuple(x.shape) for x in dq_b]
            kv_shapes = [tuple(x.shape) for x in dk_b]
            back.append(((slice(c * q_step, (c + 1) * q_step), slice(c * kv_step, (c + 1) * kv_step),
                          slice(c * kv_step, (c + 1) * kv_step)),
                         [_post_home(dq_flat.to(dout.dtype), q_shapes, rank, group),
                          _post_home(dk_flat.to(dout.dtype), kv_shapes, rank, group),
                          _post_home(dv_flat.to(dout.dtype), kv_shapes, rank, group)]))
        _land(back, (dq, dk, dv), cross)
        return dq.view(q_shape), dk.view(kv_shape), dv.view(kv_shape), None, None, None, None, dsinks
