"""The ring's steps as varlen kernel calls: one call per step for the causal segments, one for the rest.

A GPU runs many small dense calls slowly, so with packed documents each ring step gathers its segments'
query rows and K/V rows into packed tensors (``parallel/kernels/varlen.py``), makes at most two varlen calls
(flash-attn's masks are either causal or not for a whole call) and scatters the results back. Each query
row is in at most one segment of a step, so the scatter never collides; K/V rows shared by segments are
gathered once per segment and their gradients summed back with ``index_add_``.

The index tensors are the plan's (``plan/varlen_plan.py``): built for one sample with the plan and moved
with it (``RankPlan.to``), so a step copies nothing from the host; a batch of unpacked samples derives its
indices on the device once per plan. The CPU kernels emulate the varlen calls segment by segment, which is
how the suite checks this path.
"""

from __future__ import annotations

import torch

from cp_train.parallel.cp.plan.rank_plan import RankPlan
from cp_train.parallel.cp.plan.varlen_plan import VarlenCall, batched, step_varlen
from cp_train.parallel.cp.ring.blocks import BlockGrads, SavedRows
from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows
from cp_train.parallel.kernels.varlen import merge_block

__all__ = ["VarlenCall", "backward_step", "forward_step", "varlen_calls"]


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


def forward_step(kernel: AttentionKernel, calls: tuple[VarlenCall, ...], q: torch.Tensor, held: list[torch.Tensor],
                 out: torch.Tensor, lse: torch.Tensor, scale: float, first: bool) -> None:
    """One ring step forward: q, out ``[B, n, h, D]``, lse ``[B, n, h]`` (views are fine), held [k, v] stores.
    ``first``: the local step, which writes every row once instead of merging."""
    if not calls:
        return
    q_flat, out_flat, lse_flat = q.flatten(0, 1), out.flatten(0, 1), lse.flatten(0, 1)
    k_flat, v_flat = held[0].flatten(0, 1), held[1].flatten(0, 1)
    for call in calls:
        block_out, block_lse = kernel.varlen_forward(
            q_flat.index_select(0, call.q_index), k_flat.index_select(0, call.kv_index),
            v_flat.index_select(0, call.kv_index), call.segments, call.causal, scale)
        block_lse = block_lse.transpose(0, 1)
        if first:
            out_flat.index_copy_(0, call.q_index, block_out.to(out.dtype))
            lse_flat.index_copy_(0, call.q_index, block_lse.to(lse.dtype))
            continue
        current_out, current_lse = out_flat.index_select(0, call.q_index), lse_flat.index_select(0, call.q_index)
        merge_block(current_out, current_lse, block_out, block_lse)
        out_flat.index_copy_(0, call.q_index, current_out)
        lse_flat.index_copy_(0, call.q_index, current_lse)


def backward_step(kernel: AttentionKernel, calls: tuple[VarlenCall, ...], rows: SavedRows, held: list[torch.Tensor],
                  dq: torch.Tensor, scale: float) -> list[BlockGrads]:
    """One ring step backward: adds the dq share into ``dq``; returns each call's ``BlockGrads`` (its target the
    rows of the flattened accumulator). ``rows`` are the chunk's query heads."""
    if not calls:
        return []
    dout, q, out, lse = (x.flatten(0, 1) for x in rows)
    k_flat, v_flat = held[0].flatten(0, 1), held[1].flatten(0, 1)
    dq_flat = dq.flatten(0, 1)
    grads = []
    for call in calls:
        index = call.q_index
        grad = BackwardRows(dout.index_select(0, index), q.index_select(0, index), out.index_select(0, index),
                            lse.index_select(0, index).transpose(0, 1).contiguous())
        dq_b, dk_b, dv_b = kernel.varlen_backward(grad, k_flat.index_select(0, call.kv_index),
                                                  v_flat.index_select(0, call.kv_index), call.segments, call.causal,
                                                  scale)
        dq_flat.index_add_(0, call.q_index, dq_b.to(dq.dtype))
        grads.append(BlockGrads(dk_b, dv_b, call.grad_index))
    return grads
