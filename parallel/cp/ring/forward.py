"""The ring attention forward pipeline and the pieces both directions share (no autograd; see
attention.py; the backward is backward.py).

Shapes: q, dout, out ``[B, n, H, D]``; k, v ``[B, n, Hk, D]``; lse ``[B, n, H]`` (float32 accumulator
layout); ``n`` is the local sequence length of one CP rank. What each step computes and sends comes
from the rank's ``RankPlan`` (``plan/rank_plan.py``); a packed plan views every tensor ``[1, B*n, ...]``.

The forward runs over *head chunks* (``spec.forward_head_chunks``, by default one: all heads) and, inside
each, over the ring steps. Exactly one K/V transfer is in flight at any time, always for the next step
that needs remote data, so the transfer overlaps the current kernel calls. Every hop carries only the
rows later ranks still use, and empty hops are skipped.
"""

from __future__ import annotations

import torch

from cp_train.parallel.cp.plan.device import Selector
from cp_train.parallel.cp.plan.rank_plan import KernelCall, RankPlan, StepPlan
from cp_train.parallel.cp.plan.segments import Segment
from cp_train.parallel.cp.ring import varlen_steps as ring_varlen
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.cp.ring.blocks import tiles
from cp_train.parallel.cp.ring.comm import KV_TAG, RingComm, Transfer
from cp_train.parallel.cp.ring.varlen_steps import VarlenCall, varlen_calls
from cp_train.parallel.cp.ring.varlen_steps import whole_call as varlen_whole
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import accumulator_dtype
from cp_train.parallel.kernels.varlen import merge_block


def head_chunk_bounds(kv_heads: int, chunks: int) -> list[tuple[int, int]]:
    """Split ``range(kv_heads)`` into ``chunks`` contiguous, near-equal ranges."""
    chunks = max(1, min(chunks, kv_heads))
    edges = [round(i * kv_heads / chunks) for i in range(chunks + 1)]
    return [(edges[i], edges[i + 1]) for i in range(chunks)]


def pick(x: torch.Tensor, rows: Selector) -> torch.Tensor:
    """Rows ``rows`` (dim 1) of a compacted store: a view for a slice, a gathered copy for an index (on
    ``x``'s device already: ``RankPlan.to`` / ``RankPlan.on_device``)."""
    if isinstance(rows, slice):
        return x[:, rows]
    return x.index_select(1, rows)


def add_rows(total: torch.Tensor, rows: Selector, part: torch.Tensor) -> None:
    """``total[:, rows] += part`` for a slice or an index tensor (on ``total``'s device)."""
    if isinstance(rows, slice):
        total[:, rows] += part
    else:
        total.index_add_(1, rows, part)


def pass_kv(comm: RingComm, held: list[torch.Tensor], step: StepPlan, like: torch.Tensor) -> Transfer:
    """Send the held [k, v] rows later ranks use; receive the next block's (``like``: [B, n, hk, D])."""
    send_rows, recv_rows = step.kv_rows
    send = [pick(x, step.kv_send).contiguous() for x in held] if send_rows else []
    shapes = [(like.shape[0], recv_rows, *like.shape[2:])] * 2 if recv_rows else []
    return comm.exchange(send, shapes, tag=KV_TAG, like=like)


def running(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a running accumulator: ``dtype`` and contiguous (itself when already both, else one copy). The
    steps write accumulators in place through flattened views, which a kernel's own layout (a CUDA lse is
    ``[B, H, S]`` underneath its ``[B, S, H]`` transpose) would turn into copies."""
    if x.is_contiguous():
        return x.to(dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def plan_rows(x: torch.Tensor, plan: RankPlan) -> torch.Tensor:
    """``x`` [B, n, ...] as the plan's rows: itself, or ``[1, B*n, ...]`` when the plan is packed."""
    return x.reshape(1, -1, *x.shape[2:]) if plan.packed else x


def forward_step(plan: RankPlan, index: int, q: torch.Tensor, held: list[torch.Tensor], out: torch.Tensor,
                 lse: torch.Tensor, spec: AttentionSpec) -> None:
    """Step ``index`` of ``plan`` forward: q, out ``[B, n, h, D]`` and lse ``[B, n, h]`` (views of one head
    chunk, in the plan's rows), ``held`` the step's [k, v] store. Step 0 (the local block, which every query
    row sees) writes every row once; later steps merge into it."""
    step = plan.steps[index]
    if uses_varlen(spec, step):
        calls = varlen_calls(plan, index, q.shape[0], q.shape[1], q.device)
        ring_varlen.forward_step(spec.kernel, calls, q, held, out, lse, spec.scale, index == 0)
        return
    dense, rectangles = split_rectangles(spec, plan, index, q)
    written = 0  # rows [0, written) of the local step hold a first value
    for call in dense:
        segment = call.segment
        rows = slice(*segment.q)
        block_out, block_lse = call_forward(spec, segment, q, held)
        if index == 0 and segment.q[0] >= written:  # the local step covers every row: first write copies
            out[:, rows].copy_(block_out)
            lse[:, rows].copy_(block_lse)
            written = segment.q[1]
        else:
            merge_block(out[:, rows], lse[:, rows], block_out, block_lse)
        del block_out, block_lse
    if rectangles:  # merged into the rows the causal calls wrote (``rectangle_calls``)
        ring_varlen.forward_step(spec.kernel, rectangles, q, held, out, lse, spec.scale, index == 0 and not dense)


def split_rectangles(spec: AttentionSpec, plan: RankPlan, index: int, q: torch.Tensor
                     ) -> tuple[list[KernelCall], tuple[VarlenCall, ...]]:
    """Step ``index``'s dense calls and its varlen ones: with ``spec.rectangles`` (``cudnn_ragged``) a step the
    documents shape keeps its causal squares dense (a graph per power of two, built by the warm-up) and sends its
    full pieces to one varlen call (``rectangle_calls``); every call dense otherwise. q ``[B, n, ...]``."""
    step = plan.steps[index]
    rectangles = ring_varlen.rectangle_calls(plan, index, q.shape[0], q.shape[1], q.device) \
        if uses_rectangles(spec, step) else None
    if rectangles is None:
        return step.calls, ()
    return [call for call in step.calls if call.segment.causal], rectangles


def call_forward(spec: AttentionSpec, call: Segment, q: torch.Tensor, held: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense kernel call of a step: out ``[B, m, h, D]`` and lse ``[B, m, h]`` of its ``m`` query rows."""
    keys = slice(*call.kv)
    q, k, v = q[:, slice(*call.q)], held[0][:, keys], held[1][:, keys]
    if call.slide:  # an inverted triangle: the causal call on rows and keys reversed
        q, k, v = (x.flip(1) for x in (q, k, v))
        out, lse = spec.kernel.forward(q, k, v, True, spec.scale)
        return out.flip(1), lse.flip(2).transpose(1, 2)
    out, lse = spec.kernel.forward(q, k, v, call.causal, spec.scale)
    return out, lse.transpose(1, 2)


def one_call(spec: AttentionSpec, step: StepPlan, rows: int) -> bool:
    """Whether ``step`` is one dense kernel call over all ``rows`` query rows."""
    return not uses_varlen(spec, step) and not uses_rectangles(spec, step) and len(step.calls) == 1 \
        and step.calls[0].segment.q == (0, rows)


def whole_step(spec: AttentionSpec, plan: RankPlan, index: int, q: torch.Tensor) -> bool:
    """Whether step ``index`` is one kernel call (dense or varlen) over every query row of ``q`` ``[B, n, ...]``
    in order: its outputs then become the running ones."""
    if uses_varlen(spec, plan.steps[index]):
        return varlen_whole(plan, index, q.shape[0], q.shape[1], q.device) is not None
    return one_call(spec, plan.steps[index], q.shape[1])


def _local_forward(plan: RankPlan, q: torch.Tensor, held: list[torch.Tensor], spec: AttentionSpec
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The local step as one call over every row and head (``whole_step``): its outputs become the running out
    [B, n, H, D] and lse [B, n, H] (the accumulator dtype, contiguous: ``running``; no copy when the kernel's
    outputs are both already). Without remote steps (``plan.world`` 1) nothing merges into out: it stays in
    the kernel's dtype (a bf16 out cast to fp32 and back cost two copies a layer, 7 ms of an H200's 1B step)."""
    if uses_varlen(spec, plan.steps[0]):
        call = varlen_whole(plan, 0, q.shape[0], q.shape[1], q.device)
        out, lse = ring_varlen.whole_forward(spec.kernel, call, q, held, spec.scale)
    else:
        out, lse = call_forward(spec, plan.steps[0].calls[0].segment, q, held)
    acc = accumulator_dtype(q.dtype)
    return running(out, acc if plan.world > 1 else out.dtype), running(lse, acc)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: RingComm | None, spec: AttentionSpec,
                 plan: RankPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over the ring: returns out [B, n, H, D] (accumulator dtype; the kernel's own at ``plan.world`` 1
    in one head chunk, where no call merges into another's rows: ``unmerged``) and lse [B, n, H] (accumulator
    dtype)."""
    shape = q.shape
    plan = plan.on_device(q.device)
    q, k, v = plan_rows(q, plan), plan_rows(k, plan), plan_rows(v, plan)
    batch, n, heads, dim = q.shape
    group_size = heads // k.shape[2]
    acc = accumulator_dtype(q.dtype)
    chunks = head_chunk_bounds(k.shape[2], spec.forward_head_chunks)
    whole = len(chunks) == 1 and whole_step(spec, plan, 0, q)  # the local step's outputs start out, lse
    out = None if whole else torch.empty(batch, n, heads, dim, device=q.device, dtype=q.dtype if len(chunks) == 1
                                         and unmerged(spec, plan, n, k.shape[1]) else acc)
    lse = None if whole else torch.empty(batch, n, heads, dtype=acc, device=q.device)
    for k0, k1 in chunks:
        qs = slice(k0 * group_size, k1 * group_size)
        q_c = q[:, :, qs]
        k_chunk = k[:, :, k0:k1]
        held = [k_chunk, v[:, :, k0:k1]]
        if warm.needed(spec, shape[1], q_c, *held):
            warm_forward(spec, q_c, held, plan.world, shape[1])
        for index, step in enumerate(plan.steps):
            # the next block travels while this one computes
            transfer = pass_kv(comm, held, step, k_chunk) if index + 1 < plan.world else None
            if index == 0 and whole:
                out, lse = _local_forward(plan, q_c, held, spec)
            else:
                forward_step(plan, index, q_c, held, out[:, :, qs], lse[:, :, qs], spec)
            held = transfer.wait() if transfer is not None else []
    return out.reshape(*shape[:3], dim), lse.reshape(*shape[:3])


def warm_forward(spec: AttentionSpec, q: torch.Tensor, held: list[torch.Tensor], world: int, rows: int) -> None:
    """Every layout shape of ``rows`` rows per sample once (``warm.shapes``; a packed plan's calls are a sample's
    blocks) on the local K/V store ``held`` and (``world`` > 1) on one shaped as a received block: the kernel's
    per-shape plans built before a step needs them; the results are dropped."""
    stores = [held] + ([[warm.received_like(x, rows) for x in held]] if world > 1 else [])
    for store in stores:
        for segment in warm.calls(spec, rows, world):
            call_forward(spec, segment, q, store)


def unmerged(spec: AttentionSpec, plan: RankPlan, rows: int, keys: int) -> bool:
    """Whether nothing merges into the outputs of the plan's calls: one rank (no remote steps) whose local step's
    dense calls write each query row and each dK/dV row once (``blocks.tiles``; packed documents at cp 1 on a
    kernel without varlen calls). Its out, dq, dk and dv then stay in the kernel's dtype."""
    step = plan.steps[0]
    return plan.world == 1 and not uses_varlen(spec, step) and not uses_rectangles(spec, step) and \
        tiles(step, rows, keys)


def uses_varlen(spec: AttentionSpec, step: StepPlan) -> bool:
    """Varlen calls for the steps the documents shape (``StepPlan.by_documents``) on a kernel that has them
    (``spec.varlen``); dense calls for the rest (a layout's block shapes, a handful per run)."""
    return spec.varlen and step.by_documents


def uses_rectangles(spec: AttentionSpec, step: StepPlan) -> bool:
    """Whether a step the documents shape sends its full pieces to one varlen call, its causal squares staying
    dense (``spec.rectangles``: ``cudnn_ragged``; ``split_rectangles``)."""
    return spec.rectangles and step.by_documents
