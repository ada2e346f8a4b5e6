"""Ulysses and hybrid (Ulysses x ring) context-parallel attention.

An all-to-all over the Ulysses group turns this rank's ``n`` tokens of every head into every group
member's tokens (``u * n``) of ``H / u`` heads; the tokens are put in sequence order, attended (the
whole sequence for ``ulysses``; the ring across the Ulysses groups for ``hybrid``), put back in rank
order, and a second all-to-all returns each rank its own tokens of every head. With fewer kv heads than
``u`` each kv head is repeated just enough for every rank to hold one (its gradient sums back).

The heads go in chunks, so the all-to-alls of one chunk travel while another computes: chunk c+1's
inputs and chunk c-1's output are in flight during chunk c's attention, in the forward and the
backward alike. ``ulysses`` with packed documents runs ``documents.py`` instead: documents
wholly on one rank stay there, and only the other rows take the all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.plan.window_plan import flash_window
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.comm import RingComm, count_sent
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.sinks import apply_sinks, sink_grad
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.cp.ulysses.documents import Pending, UlyssesDocumentsAttention
from cp_train.parallel.kernels.contract import BackwardRows, accumulator_dtype


def _post_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """Start ``[B, n, h, D]`` (this rank's tokens) -> ``[B, u*n, h/u, D]`` (the group's tokens, rank by rank)."""
    u = dist.get_world_size(group)
    batch, n, heads, dim = x.shape
    send = x.reshape(batch, n, u, heads // u, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    count_sent("all_to_all", send, (u - 1) / u)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return work, lambda: recv.permute(1, 0, 2, 3, 4).reshape(batch, u * n, heads // u, dim)


def _post_heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """Start the inverse: ``[B, u*n, h, ...]`` -> ``[B, n, u*h, ...]`` (block j of the rows goes to rank j)."""
    u = dist.get_world_size(group)
    batch, rows = x.shape[:2]
    send = x.reshape(batch, u, rows // u, *x.shape[2:]).transpose(0, 1).contiguous()  # [u, B, n, h, ...]
    recv = torch.empty_like(send)
    count_sent("all_to_all", send, (u - 1) / u)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return work, lambda: recv.movedim(0, 2).flatten(2, 3)


def _done(pending: Pending) -> torch.Tensor:
    work, result = pending
    work.wait()
    return result()


def _land(back: list[tuple[int, list[Pending]]], targets: tuple[torch.Tensor, ...], steps: tuple[int, ...]) -> None:
    """Write each head chunk's returning tensors into its heads of ``targets`` (``steps`` heads per chunk each)."""
    for c, pendings in back:
        for target, step, pending in zip(targets, steps, pendings, strict=True):
            target[:, :, c * step:(c + 1) * step] = _done(pending)


def _order(plan: CPPlan) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(order, its inverse), flat: rank-order rows -> sequence order and back (the plan's, on its device)."""
    return None if plan.order is None else (plan.order.flatten(), plan.inverse)


def _in_order(x: torch.Tensor, plan: CPPlan) -> torch.Tensor:
    """Rows of ``x`` [B, rows, ...] in sequence order (the folded batch when the plan is packed)."""
    if plan.packed:
        x = x.reshape(1, -1, *x.shape[2:])
    order = _order(plan)
    return x if order is None else x.index_select(1, order[0])


def _in_rank_order(x: torch.Tensor, plan: CPPlan, batch: int) -> torch.Tensor:
    order = _order(plan)
    if order is not None:
        x = x.index_select(1, order[1])
    return x.reshape(batch, -1, *x.shape[2:])


def native_window(spec: AttentionSpec, plan: CPPlan) -> tuple[int, int] | None:
    """flash-attn's window for a kernel that takes one (``native_window``) when ``plan`` is Ulysses' one document
    with a window (a one-rank plan of the whole sequence); None: the plan's segments run (the CPU kernel, cuDNN:
    full, causal and inverted-triangle calls)."""
    if plan.window is None or plan.ring is None or plan.ring.world != 1 or plan.documents is not None:
        return None
    if not getattr(spec.kernel, "native_window", False):
        return None
    return flash_window(plan.window, spec.causal)


def chunk_count(heads: int, kv_heads: int, u: int, wanted: int) -> int:
    """Head chunks (at most ``wanted``) whose q and kv heads both split over the ``u`` ranks of the group."""
    return max(c for c in range(1, wanted + 1) if heads % (c * u) == 0 and kv_heads % (c * u) == 0)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, ring_group, spec: AttentionSpec, plan: CPPlan, chunks: int, sinks=None):
        batch, n, heads, dim = q.shape
        u, member = dist.get_world_size(group), dist.get_rank(group)
        kv_heads = k.shape[2]
        comm = RingComm(ring_group) if ring_group is not None else None
        q_step, kv_step = heads // chunks, kv_heads // chunks

        def post(c: int) -> list[Pending]:
            return [_post_seq_to_heads(x[:, :, c * w:(c + 1) * w], group)
                    for x, w in ((q, q_step), (k, kv_step), (v, kv_step))]

        out = torch.empty(batch, n, heads, dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, n, heads, dtype=accumulator_dtype(q.dtype), device=q.device)
        saved, back, pending = [], [], post(0)
        for c in range(chunks):
            q_h, k_h, v_h = (_in_order(_done(p), plan) for p in pending)
            pending = post(c + 1) if c + 1 < chunks else []
            if plan.ring is None or native_window(spec, plan) is not None:  # the window goes to the kernel
                window = native_window(spec, plan)
                out_h, lse_h = spec.kernel.forward(q_h, k_h, v_h, spec.causal, spec.scale,
                                                   **({} if window is None else {"window": window}))
                lse_h = lse_h.transpose(1, 2)
            else:
                out_h, lse_h = ring_forward(q_h, k_h, v_h, comm, spec, plan.ring)
            if sinks is not None:  # this rank's heads of the chunk (``_post_seq_to_heads``)
                first = c * q_step + member * (q_step // u)
                apply_sinks(out_h, lse_h, sinks[first:first + q_step // u])
            out_h = out_h.to(q.dtype)
            saved += [q_h, k_h, v_h, out_h, lse_h]
            back.append((c, [_post_heads_to_seq(_in_rank_order(out_h, plan, batch), group),
                             _post_heads_to_seq(_in_rank_order(lse_h.to(lse.dtype), plan, batch), group)]))
        _land(back, (out, lse), (q_step, q_step))
        ctx.save_for_backward(*saved, *(() if sinks is None else (out, lse, sinks)))
        ctx.group, ctx.comm, ctx.spec, ctx.plan, ctx.chunks = group, comm, spec, plan, chunks
        ctx.shapes = (batch, n, heads, kv_heads, dim)
        lse = lse.transpose(1, 2)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        group, comm, spec, plan, chunks = ctx.group, ctx.comm, ctx.spec, ctx.plan, ctx.chunks
        batch, n, heads, kv_heads, dim = ctx.shapes
        q_step, kv_step = heads // chunks, kv_heads // chunks
        saved = ctx.saved_tensors
        dsinks = sink_grad(dout, *saved[5 * chunks:]) if len(saved) > 5 * chunks else None
        dq = torch.empty(batch, n, heads, dim, dtype=dout.dtype, device=dout.device)
        dk = torch.empty(batch, n, kv_heads, dim, dtype=dout.dtype, device=dout.device)
        dv = torch.empty_like(dk)

        def post(c: int) -> Pending:
            return _post_seq_to_heads(dout[:, :, c * q_step:(c + 1) * q_step].contiguous(), group)

        back, pending = [], post(0)
        for c in range(chunks):
            dout_h = _in_order(_done(pending), plan)
            pending = post(c + 1) if c + 1 < chunks else None
            q_h, k_h, v_h, out_h, lse_h = saved[5 * c: 5 * c + 5]
            window = native_window(spec, plan)
            if plan.ring is None or window is not None:
                grads = spec.kernel.backward(BackwardRows(dout_h, q_h, out_h, lse_h.transpose(1, 2).contiguous()),
                                             k_h, v_h, spec.causal, spec.scale,
                                             **({} if window is None else {"window": window}))
            else:
                grads = ring_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, comm, spec, plan.ring)
            back.append((c, [_post_heads_to_seq(_in_rank_order(g.to(dout.dtype), plan, batch), group)
                             for g in grads]))
        _land(back, (dq, dk, dv), (q_step, kv_step, kv_step))
        return dq, dk, dv, None, None, None, None, None, dsinks


def ulysses_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                 ring_group: dist.ProcessGroup | None, spec: AttentionSpec, plan: CPPlan,
                 sinks: torch.Tensor | None = None) -> tuple[type[torch.autograd.Function], tuple]:
    """The autograd Function of Ulysses over ``group`` (with the hybrid's ring over ``ring_group`` across the
    groups; None: none) and its ``apply`` arguments. With fewer kv heads than the group's ranks, the k and v
    passed on are ``repeat_interleave``d along dim 2 (differentiably here; a caller running the Function's
    backward itself sums their gradients back). ``spec.head_chunks`` bounds the head chunks whose all-to-alls
    overlap the attention. ``sinks`` ``[H]`` are applied to each rank's heads before the output travels back."""
    plan = plan.on_device(q.device)  # itself when moved ahead (``CPPlan.to``): no host copy in the call
    u = dist.get_world_size(group)
    if k.shape[2] < u:  # every rank needs a kv head: repeat each just enough
        k, v = (x.repeat_interleave(u // k.shape[2], dim=2) for x in (k, v))
    chunks = chunk_count(q.shape[2], k.shape[2], u, max(1, spec.head_chunks))
    if plan.documents is not None:
        return UlyssesDocumentsAttention, (q, k, v, group, spec, plan, chunks, sinks)
    return _UlyssesAttention, (q, k, v, group, ring_group, spec, plan, chunks, sinks)

