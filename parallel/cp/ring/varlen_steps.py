"""The ring's steps as varlen kernel calls: one call per step for the causal segments, one for the rest.

A GPU runs many small dense calls slowly, so with packed documents each ring step gathers its segments'
query rows and K/V rows into packed tensors (``parallel/kernels/varlen.py``), makes at most two varlen calls
(flash-attn's masks are either causal or not for a whole call) and scatters the results back. Each query
row is in at most one segment of a step, so the scatter never collides; K/V rows shared by segments are
gathered once per segment and their gradients summed back with ``index_add_``.

Index tensors are built once per (plan, step, batch, device) and kept in the plan's cache. The CPU
kernels emulate the varlen calls segment by segment, which is how the suite checks this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_train.parallel.cp.plan.rank_plan import RankPlan
from cp_train.parallel.cp.ring.blocks import BlockGrads, SavedRows
from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows, VarlenSegments
from cp_train.parallel.kernels.select import KERNEL_CALLS
from cp_train.parallel.kernels.varlen import merge_block


@dataclass(frozen=True)
class VarlenCall:
    """One varlen call: ``q_index`` rows of the flattened ``[B*n]`` queries, ``kv_index`` of the flattened held
    K/V store, ``grad_index`` of the flattened dK/dV accumulator; ``segments`` as the kernel takes them."""

    causal: bool
    q_index: torch.Tensor
    kv_index: torch.Tensor
    grad_index: torch.Tensor
    segments: VarlenSegments


def varlen_calls(plan: RankPlan, index: int, batch: int, rows: int, device: torch.device) -> list[VarlenCall]:
    """The (at most two) varlen calls of step ``index`` for ``batch`` samples of ``rows`` queries (cached)."""
    key = ("varlen", index, batch, rows, str(device))
    if key not in plan.cache:
        step = plan.steps[index]
        calls = []
        for causal in (True, False):
            q_parts, kv_parts, grad_parts, lengths_q, lengths_k = [], [], [], [], []
            for b in range(batch):
                for segment, grad in zip(step.segments, step.grad_kv, strict=True):
                    if segment.causal != causal:
                        continue
                    q_parts.append(torch.arange(*segment.q) + b * rows)
                    kv_parts.append(torch.arange(*segment.kv) + b * step.held_rows)
                    grad_parts.append(torch.arange(*grad) + b * step.acc_rows)
                    lengths_q.append(segment.rows)
                    lengths_k.append(segment.keys)
            if not q_parts:
                continue
            cu = [torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
                  for lengths in (lengths_q, lengths_k)]
            calls.append(VarlenCall(causal, *(torch.cat(p).to(device) for p in (q_parts, kv_parts, grad_parts)),
                                    VarlenSegments(cu[0].to(device), cu[1].to(device), max(lengths_q),
                                                   max(lengths_k))))
        plan.cache[key] = calls
    return plan.cache[key]


def forward_step(kernel: AttentionKernel, calls: list[VarlenCall], q: torch.Tensor, held: list[torch.Tensor],
                 out: torch.Tensor, lse: torch.Tensor, scale: float, first: bool) -> None:
    """One ring step forward: q, out ``[B, n, h, D]``, lse ``[B, n, h]`` (views are fine), held [k, v] stores.
    ``first``: the local step, which writes every row once instead of merging."""
    if not calls:
        return
    q_flat, out_flat, lse_flat = q.flatten(0, 1), out.flatten(0, 1), lse.flatten(0, 1)
    k_flat, v_flat = held[0].flatten(0, 1), held[1].flatten(0, 1)
    for call in calls:
        KERNEL_CALLS["forward"] += 1
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


def backward_step(kernel: AttentionKernel, calls: list[VarlenCall], rows: SavedRows, held: list[torch.Tensor],
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
        KERNEL_CALLS["backward"] += 1
        index = call.q_index
        grad = BackwardRows(dout.index_select(0, index), q.index_select(0, index), out.index_select(0, index),
                            lse.index_select(0, index).transpose(0, 1).contiguous())
        dq_b, dk_b, dv_b = kernel.varlen_backward(grad, k_flat.index_select(0, call.kv_index),
                                                  v_flat.index_select(0, call.kv_index), call.segments, call.causal,
                                                  scale)
        dq_flat.index_add_(0, call.q_index, dq_b.to(dq.dtype))
        grads.append(BlockGrads(dk_b, dv_b, call.grad_index))
    return grads
