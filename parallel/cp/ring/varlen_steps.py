"""The ring's steps as varlen kernel calls: one call per step for the causal segments, one for the rest.

A step whose calls the documents shape (``StepPlan.by_documents``) would issue dense calls of new shapes in
almost every micro-batch (a cuDNN graph each) and many small launches, so on a kernel with varlen calls it
gathers its segments' query rows and K/V rows into packed tensors, makes at most two varlen calls
(flash-attn's masks are either causal or not for a whole call) and scatters the results back. Each query
row is in at most one segment of a step, so the scatter never collides; K/V rows shared by segments are
gathered once per segment and their gradients summed back with ``index_add_``. An index that is one stretch
of rows is a slice: nothing is gathered or scattered for it (views), and a call over every query row in order
hands its outputs over as the step's own (``whole_call``; every call at cp 1).

The index tensors are the plan's (``plan/varlen_plan.py``): built for one sample with the plan and moved
with it (``RankPlan.to``), so a step copies nothing from the host; a batch of unpacked samples derives its
indices on the device once per plan. The CPU kernels emulate the varlen calls segment by segment, which is
how the suite checks this path.
"""

from __future__ import annotations

import torch

from cp_train.parallel.cp.plan.device import Selector
from cp_train.parallel.cp.plan.rank_plan import RankPlan
from cp_train.parallel.cp.plan.varlen_plan import VarlenCall, batched, step_varlen
from cp_train.parallel.cp.ring.blocks import BlockGrads, SavedRows, cover
from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows, QKVGrads
from cp_train.parallel.kernels.varlen import merge_block

__all__ = ["VarlenCall", "backward_step", "flat_view", "forward_step", "rectangle_calls", "varlen_calls",
           "whole_backward", "whole_call", "whole_forward"]


def varlen_calls(plan: RankPlan, index: int, batch: int, rows: int, device: torch.device
                 ) -> tuple[VarlenCall, ...]:
    """The (at most two) varlen calls of step ``index`` for ``batch`` samples of ``rows`` queries: the plan's own
    (moved with it); derived on ``device`` for ``batch`` > 1 (cached in the plan). A plan that was never
    moved or pinned builds them here once (cached)."""
    step = plan.steps[index]
    calls = step.varlen
    if calls is None:  # a plan used where it was not moved ahead: built and moved once
        key = ("varlen", index, str(device))
        if key not in plan.cache:
            built = step_varlen(step.segments, step.grad_kv)
            plan.cache[key] = tuple(call.apply(lambda x: x.to(device)) for call in built)
        calls = plan.cache[key]
    if batch == 1:
        return calls
    key = ("varlen", index, batch, rows, str(device))
    if key not in plan.cache:
        plan.cache[key] = batched(calls, batch, rows, step.held_rows, step.acc_rows)
    return plan.cache[key]


def rectangle_calls(plan: RankPlan, index: int, batch: int, rows: int, device: torch.device
                    ) -> tuple[VarlenCall, ...] | None:
    """Step ``index``'s full (non-causal) dense calls as one varlen call, its causal calls staying dense
    (``AttentionSpec.rectangles``); None where every call stays dense: none is full, or the local step's causal
    calls leave a query row to the full ones (they write each row first; the full call merges into them). Built
    on the host once per plan and step, moved without a sync (cached in the plan); ``batch`` as ``varlen_calls``."""
    key = ("rectangles", index, str(device))
    if key not in plan.cache:
        plan.cache[key] = _rectangles(plan, index, device)
    calls = plan.cache[key]
    if calls is None or batch == 1:
        return calls
    step, key = plan.steps[index], ("rectangles", index, batch, rows, str(device))
    if key not in plan.cache:
        plan.cache[key] = batched(calls, batch, rows, step.held_rows, step.acc_rows)
    return plan.cache[key]


def _rectangles(plan: RankPlan, index: int, device: torch.device) -> tuple[VarlenCall, ...] | None:
    step = plan.steps[index]
    full = [call for call in step.calls if not call.segment.causal]
    causal = sorted(call.segment.q for call in step.calls if call.segment.causal)
    if not full or (index == 0 and causal and not cover(causal, plan.rows)):
        return None
    built = step_varlen(tuple(call.segment for call in full), tuple(call.grad_kv for call in full))

    def move(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)

    return tuple(call.apply(move) for call in built)


def rows_of(x: torch.Tensor, index: Selector) -> torch.Tensor:
    """Rows ``index`` of a flattened ``[T, ...]`` tensor: a view for a slice, a gathered copy for an index."""
    return x[index] if isinstance(index, slice) else x.index_select(0, index)


def flat_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, n, ...]`` as ``[B*n, ...]`` for writing in place: a view, or RuntimeError where it cannot be one
    (``flatten`` would copy silently and the writes would be lost)."""
    return x.view(-1, *x.shape[2:])


def whole_call(plan: RankPlan, index: int, batch: int, rows: int, device: torch.device) -> VarlenCall | None:
    """Step ``index``'s one varlen call when it covers every query row in order (``batch`` samples of ``rows``),
    else None: its outputs are then the step's own (nothing staged, nothing zeroed)."""
    calls = varlen_calls(plan, index, batch, rows, device)
    return calls[0] if len(calls) == 1 and calls[0].covers(batch * rows) else None


def whole_forward(kernel: AttentionKernel, call: VarlenCall, q: torch.Tensor, held: list[torch.Tensor], scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``call`` over every query row: out ``[B, n, h, D]`` and lse ``[B, n, h]`` (views of the kernel's)."""
    out, lse = kernel.varlen_forward(q.flatten(0, 1), rows_of(held[0].flatten(0, 1), call.kv_index),
                                     rows_of(held[1].flatten(0, 1), call.kv_index), call.segments, call.causal, scale)
    return out.view(q.shape), lse.transpose(0, 1).reshape(q.shape[:3])


def forward_step(kernel: AttentionKernel, calls: tuple[VarlenCall, ...], q: torch.Tensor, held: list[torch.Tensor],
                 out: torch.Tensor, lse: torch.Tensor, scale: float, first: bool) -> None:
    """One ring step forward: q, out ``[B, n, h, D]``, lse ``[B, n, h]`` (views are fine if dims 0 and 1 merge:
    ``flat_view``), held [k, v] stores.
    ``first``: the local step, which writes every row once instead of merging."""
    if not calls:
        return
    q_flat, out_flat, lse_flat = q.flatten(0, 1), flat_view(out), flat_view(lse)
    k_flat, v_flat = held[0].flatten(0, 1), held[1].flatten(0, 1)
    for call in calls:
        block_out, block_lse = kernel.varlen_forward(
            rows_of(q_flat, call.q_index), rows_of(k_flat, call.kv_index), rows_of(v_flat, call.kv_index),
            call.segments, call.causal, scale)
        block_lse = block_lse.transpose(0, 1)
        rows = call.q_index
        if isinstance(rows, slice):  # views: written or merged in place
            if first:
                out_flat[rows].copy_(block_out)
                lse_flat[rows].copy_(block_lse)
            else:
                merge_block(out_flat[rows], lse_flat[rows], block_out, block_lse)
            continue
        if first:
            out_flat.index_copy_(0, rows, block_out.to(out.dtype))
            lse_flat.index_copy_(0, rows, block_lse.to(lse.dtype))
            continue
        current_out, current_lse = out_flat.index_select(0, rows), lse_flat.index_select(0, rows)
        merge_block(current_out, current_lse, block_out, block_lse)
        out_flat.index_copy_(0, rows, current_out)
        lse_flat.index_copy_(0, rows, current_lse)


def _call_backward(kernel: AttentionKernel, call: VarlenCall, rows: SavedRows, held: list[torch.Tensor],
                   scale: float) -> QKVGrads:
    """One varlen call's dq (its query rows) and dk, dv (its key rows), flattened."""
    dout, q, out, lse = (x.flatten(0, 1) for x in rows)
    index = call.q_index
    grad = BackwardRows(rows_of(dout, index), rows_of(q, index), rows_of(out, index),
                        rows_of(lse, index).transpose(0, 1).contiguous())
    return kernel.varlen_backward(grad, rows_of(held[0].flatten(0, 1), call.kv_index),
                                  rows_of(held[1].flatten(0, 1), call.kv_index), call.segments, call.causal, scale)


def block_grads(dk: torch.Tensor, dv: torch.Tensor, target: Selector, batch: int) -> BlockGrads:
    """A varlen call's flattened dK/dV as ``BlockGrads``: a slice target becomes an interval of dim 1 (one
    sample; or the whole accumulator, every sample in order), an index stays one of the flattened rows."""
    if not isinstance(target, slice):
        return BlockGrads(dk, dv, target)
    if batch == 1:
        return BlockGrads(dk[None], dv[None], (target.start, target.stop))
    per = target.stop // batch  # a batch's slice is always the whole accumulator (``batched``)
    return BlockGrads(dk.view(batch, per, *dk.shape[1:]), dv.view(batch, per, *dv.shape[1:]), (0, per))


def whole_backward(kernel: AttentionKernel, call: VarlenCall, rows: SavedRows, held: list[torch.Tensor],
                   scale: float) -> tuple[torch.Tensor, BlockGrads]:
    """``call`` over every query row: dq ``[B, n, h, D]`` (a view of the kernel's) and its ``BlockGrads``."""
    dq, dk, dv = _call_backward(kernel, call, rows, held, scale)
    return dq.view(rows.q.shape), block_grads(dk, dv, call.grad_index, rows.q.shape[0])


def backward_step(kernel: AttentionKernel, calls: tuple[VarlenCall, ...], rows: SavedRows, held: list[torch.Tensor],
                  dq: torch.Tensor, scale: float) -> list[BlockGrads]:
    """One ring step backward: adds the dq share into ``dq``; returns each call's ``BlockGrads``. ``rows`` are
    the chunk's query heads."""
    dq_flat = flat_view(dq)
    grads = []
    for call in calls:
        dq_b, dk_b, dv_b = _call_backward(kernel, call, rows, held, scale)
        if isinstance(call.q_index, slice):
            dq_flat[call.q_index] += dq_b
        else:
            dq_flat.index_add_(0, call.q_index, dq_b.to(dq.dtype))
        grads.append(block_grads(dk_b, dv_b, call.grad_index, rows.q.shape[0]))
    return grads
