"""Ring attention forward and backward pipelines (no autograd; see ring_attention.py).

Shapes: q, dout, out ``[B, n, H, D]``; k, v ``[B, n, Hk, D]``; lse ``[B, n, H]`` (float32 accumulator
layout); ``n`` is the local sequence length of one CP rank. What each step computes and sends comes
from the rank's ``RankPlan`` (``attention_plan.py``); a packed plan views every tensor ``[1, B*n, ...]``.

The work runs over *head chunks* (groups of kv heads with their query heads: ``spec.head_chunks`` in the
backward, ``spec.forward_head_chunks``, by default one, in the forward) and, inside each chunk,
over the ring steps. Exactly one K/V transfer is in flight at any time, always for the next step that
needs remote data, so the transfer overlaps the current kernel calls. Splitting by head chunks bounds
the transient buffers (received K/V, travelling dK/dV) to one chunk's size; every hop carries only the
rows later ranks still use, and empty hops are skipped.

Backward, per chunk: the local step first, written straight into dq/dk/dv; then the remote steps. The
dK/dV accumulator of a block starts on the first rank that uses it, travels the ring with the K/V,
grows by the rows each rank touches and arrives home at the block's owner, which adds it to its own
share. dQ stays local. Nothing saved is recomputed. Buffers are dropped as soon as they are sent.

Overlap policy (``AttentionSpec.overlap``, ``cp_attention.default_overlap``): two hops of each
chunk's backward have no kernel call of their own chunk to hide behind, the first K/V hop and the
dK/dV accumulator's last hop home. With ``overlap`` (GPUs; CPU with packed documents) the first K/V
hop is posted before the chunk's local step and the last dK/dV hop lands after the *next* chunk's
local step, so both travel during compute and ranks whose steps differ in length wait only for the
totals, at the price of one more K/V and one more dK/dV buffer alive at a time. Without it (CPU with
one document, where memory is the tighter budget and every rank's steps are equal) each waits in place.
"""

from __future__ import annotations

import torch

from parallel import ring_varlen
from parallel.attention_plan import RankPlan, Selector, StepPlan
from parallel.attention_spec import AttentionSpec
from parallel.kernels import KERNEL_CALLS
from parallel.ring_comm import RingComm, Transfer
from parallel.ring_varlen import varlen_calls
from parallel.varlen import merge_block

KV_TAG, GRAD_TAG = 0, 1


def head_chunk_bounds(kv_heads: int, chunks: int) -> list[tuple[int, int]]:
    """Split ``range(kv_heads)`` into ``chunks`` contiguous, near-equal ranges."""
    chunks = max(1, min(chunks, kv_heads))
    edges = [round(i * kv_heads / chunks) for i in range(chunks + 1)]
    return [(edges[i], edges[i + 1]) for i in range(chunks)]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pick(x: torch.Tensor, rows: Selector) -> torch.Tensor:
    """Rows ``rows`` (dim 1) of a compacted store: a view for a slice, a gathered copy for an index (on
    ``x``'s device: ``RankPlan.on_device``; the ``to`` is then free)."""
    if isinstance(rows, slice):
        return x[:, rows]
    return x.index_select(1, rows.to(x.device))


def add_rows(total: torch.Tensor, rows: Selector, part: torch.Tensor) -> None:
    """``total[:, rows] += part`` for a slice or an index tensor."""
    if isinstance(rows, slice):
        total[:, rows] += part
    else:
        total.index_add_(1, rows.to(total.device), part)


def _pass_kv(comm: RingComm, held: list[torch.Tensor], step: StepPlan, like: torch.Tensor) -> Transfer:
    """Send the held [k, v] rows later ranks use; receive the next block's (``like``: [B, n, hk, D])."""
    send_rows, recv_rows = step.kv_rows
    send = [pick(x, step.kv_send).contiguous() for x in held] if send_rows else []
    shapes = [(like.shape[0], recv_rows, *like.shape[2:])] * 2 if recv_rows else []
    return comm.exchange(send, shapes, tag=KV_TAG, like=like)


def plan_rows(x: torch.Tensor, plan: RankPlan) -> torch.Tensor:
    """``x`` [B, n, ...] as the plan's rows: itself, or ``[1, B*n, ...]`` when the plan is packed."""
    return x.reshape(1, -1, *x.shape[2:]) if plan.packed else x


def forward_step(plan: RankPlan, index: int, q: torch.Tensor, held: list[torch.Tensor], out: torch.Tensor,
                 lse: torch.Tensor, spec: AttentionSpec) -> None:
    """Step ``index`` of ``plan`` forward: q, out ``[B, n, h, D]`` and lse ``[B, n, h]`` (views of one head
    chunk, in the plan's rows), ``held`` the step's [k, v] store. Step 0 (the local block, which every query
    row sees) writes every row once; later steps merge into it."""
    step = plan.steps[index]
    if _varlen(spec, step):
        calls = varlen_calls(plan, index, q.shape[0], q.shape[1], q.device)
        ring_varlen.forward_step(spec.kernel, calls, q, held, out, lse, spec.scale, index == 0)
        return
    written = 0  # rows [0, written) of the local step hold a first value
    for call, _ in step.calls:
        KERNEL_CALLS["forward"] += 1
        rows, keys = slice(*call.q), slice(*call.kv)
        block_out, block_lse = spec.kernel.forward(q[:, rows], held[0][:, keys], held[1][:, keys], call.causal,
                                                   spec.scale)
        block_lse = block_lse.transpose(1, 2)
        if index == 0 and call.q[0] >= written:  # the local step covers every row: first write copies
            out[:, rows].copy_(block_out)
            lse[:, rows].copy_(block_lse)
            written = call.q[1]
        else:
            merge_block(out[:, rows], lse[:, rows], block_out, block_lse)
        del block_out, block_lse


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: RingComm | None, spec: AttentionSpec,
                 plan: RankPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over the ring: returns out [B, n, H, D] (accumulator dtype) and lse [B, n, H]."""
    shape = q.shape
    plan = plan.on_device(q.device)
    q, k, v = plan_rows(q, plan), plan_rows(k, plan), plan_rows(v, plan)
    batch, n, heads, dim = q.shape
    group_size = heads // k.shape[2]
    acc = accumulator_dtype(q.dtype)
    out = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
    lse = torch.empty(batch, n, heads, dtype=acc, device=q.device)
    for k0, k1 in head_chunk_bounds(k.shape[2], spec.forward_head_chunks):
        qs = slice(k0 * group_size, k1 * group_size)
        q_c, out_c, lse_c = q[:, :, qs], out[:, :, qs], lse[:, :, qs]
        k_chunk = k[:, :, k0:k1]
        held = [k_chunk, v[:, :, k0:k1]]
        for index, step in enumerate(plan.steps):
            # the next block travels while this one computes
            transfer = _pass_kv(comm, held, step, k_chunk) if index + 1 < plan.world else None
            forward_step(plan, index, q_c, held, out_c, lse_c, spec)
            held = transfer.wait() if transfer is not None else []
    return out.view(*shape[:3], dim), lse.view(*shape[:3])


Grads = list[tuple[torch.Tensor, torch.Tensor, "tuple[int, int] | torch.Tensor"]]


def add_grad(total: torch.Tensor, part: torch.Tensor, target: tuple[int, int] | torch.Tensor) -> None:
    """Add one call's dK (or dV) to an accumulator: rows ``target`` (an interval of dim 1), or the rows of
    the flattened ``[B*rows]`` accumulator a varlen call names (an index tensor)."""
    if isinstance(target, tuple):
        total[:, target[0]:target[1]] += part
    else:
        total.flatten(0, 1).index_add_(0, target, part.to(total.dtype))


def _varlen(spec: AttentionSpec, step: StepPlan) -> bool:
    """Varlen calls for steps of many segments (packed documents); dense views where a step is one or two
    calls (the one-document layouts), which gathers nothing."""
    return spec.varlen and len(step.calls) > 2


def _covers(target: tuple[int, int] | torch.Tensor, rows: int) -> bool:
    """Whether one call's gradient rows are all ``rows`` of the accumulator, in order."""
    return isinstance(target, tuple) and target == (0, rows)


def step_grads(plan: RankPlan, index: int, rows: tuple[torch.Tensor, ...], held: list[torch.Tensor],
                dq: torch.Tensor, spec: AttentionSpec) -> Grads:
    """One step's backward: adds its dq share into ``dq``; returns (dk, dv, accumulator rows) per call.

    ``rows`` = (dout, q, out, lse) of the chunk's query heads; ``held`` the K/V store of the step.
    """
    step = plan.steps[index]
    if _varlen(spec, step):
        calls = varlen_calls(plan, index, rows[1].shape[0], rows[1].shape[1], dq.device)
        return ring_varlen.backward_step(spec.kernel, calls, rows, held, dq, spec.scale)
    grads = []
    for call, grad_rows in step.calls:
        q_rows, keys = slice(*call.q), slice(*call.kv)
        dout, q, out, lse = (x[:, q_rows] for x in rows)
        KERNEL_CALLS["backward"] += 1
        dq_b, dk_b, dv_b = spec.kernel.backward(dout, q, held[0][:, keys], held[1][:, keys], out,
                                                lse.transpose(1, 2), call.causal, spec.scale)
        dq[:, q_rows] += dq_b
        grads.append((dk_b, dv_b, grad_rows))
    return grads


def _land(homecoming: list[tuple[Transfer, torch.Tensor, torch.Tensor]], home: Selector) -> None:
    """Wait for each chunk's dK/dV accumulator arriving home and add it to the chunk's own (dk, dv)."""
    for transfer, dk_c, dv_c in homecoming:
        arrived = transfer.wait()
        if arrived:
            add_rows(dk_c, home, arrived[0])
            add_rows(dv_c, home, arrived[1])
    homecoming.clear()


def local_grads(plan: RankPlan, rows: tuple[torch.Tensor, ...], held: list[torch.Tensor], dq_c: torch.Tensor,
                 dk_c: torch.Tensor, dv_c: torch.Tensor, spec: AttentionSpec) -> None:
    """The local step: dq, dk, dv of the chunk's own block, written straight into the outputs."""
    dq_c.zero_()
    grads = step_grads(plan, 0, rows, held, dq_c, spec)
    if len(grads) == 1 and _covers(grads[0][2], dk_c.shape[1]):  # one call over every row: copy, no zeroing
        dk_c.copy_(grads[0][0])
        dv_c.copy_(grads[0][1])
        return
    dk_c.zero_()
    dv_c.zero_()
    for dk_b, dv_b, target in grads:
        add_grad(dk_c, dk_b, target)
        add_grad(dv_c, dv_b, target)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, comm: RingComm | None, spec: AttentionSpec, plan: RankPlan
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward over the ring: dq [B, n, H, D], dk, dv [B, n, Hk, D] in the accumulator dtype."""
    q_shape, kv_shape = q.shape, k.shape
    plan = plan.on_device(q.device)
    dout, q, k, v, out, lse = (plan_rows(x, plan) for x in (dout, q, k, v, out, lse))
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    group_size = heads // kv_heads
    acc = accumulator_dtype(q.dtype)
    dq = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
    dk = torch.empty(*k.shape[:2], kv_heads, dim, dtype=acc, device=q.device)  # k may hold other rows (all-gather)
    dv = torch.empty_like(dk)
    homecoming: list[tuple[Transfer, torch.Tensor, torch.Tensor]] = []  # dK/dV hops still travelling home
    for k0, k1 in head_chunk_bounds(kv_heads, spec.head_chunks):
        qs = slice(k0 * group_size, k1 * group_size)
        dout_c = dout[:, :, qs]
        if batch == 1 and not dout_c.is_contiguous():  # the CPU kernel copies a strided dout in every call
            dout_c = dout_c.contiguous()
        rows = (dout_c, q[:, :, qs], out[:, :, qs], lse[:, :, qs])
        k_c, v_c, dq_c, dk_c, dv_c = k[:, :, k0:k1], v[:, :, k0:k1], dq[:, :, qs], dk[:, :, k0:k1], dv[:, :, k0:k1]
        first = plan.steps[0]
        kv_transfer = _pass_kv(comm, [k_c, v_c], first, k_c) if comm is not None and spec.overlap else None
        local_grads(plan, rows, [k_c, v_c], dq_c, dk_c, dv_c, spec)
        _land(homecoming, plan.home)  # the previous chunk's last hop travelled during this local step
        if comm is None:
            continue
        if kv_transfer is None:  # posted only now, so the local step and the hop never hold memory at once
            kv_transfer = _pass_kv(comm, [k_c, v_c], first, k_c)
        grad_transfer = None
        for index in range(1, plan.world):
            step = plan.steps[index]
            held = kv_transfer.wait()
            kv_transfer = _pass_kv(comm, held, step, k_c) if index + 1 < plan.world else None
            grads = step_grads(plan, index, rows, held, dq_c, spec)
            del held
            arriving = grad_transfer.wait() if grad_transfer is not None else []
            accumulator = _accumulate(arriving, step, grads, dk_c)
            del arriving, grads
            # pass the accumulator on; after the last hop every accumulator arrives at its owner
            recv_rows = step.grad_rows[1]
            shapes = [(batch, recv_rows, k1 - k0, dim)] * 2 if recv_rows else []
            grad_transfer = comm.exchange(accumulator, shapes, tag=GRAD_TAG, like=dk_c)
            del accumulator
        homecoming.append((grad_transfer, dk_c, dv_c))
        if not spec.overlap:
            _land(homecoming, plan.home)
    _land(homecoming, plan.home)
    return dq.view(q_shape[:3] + (dim,)), dk.view(kv_shape[:3] + (dim,)), dv.view(kv_shape[:3] + (dim,))


def _accumulate(arriving: list[torch.Tensor], step: StepPlan, grads: Grads, like: torch.Tensor
                ) -> list[torch.Tensor]:
    """The travelling [dk, dv] accumulator after this step: the arriving one (rows of earlier ranks, placed by
    ``step.grad_grow``) plus this rank's calls, in ``step.grad_rows[0]`` rows (empty: nothing to send).
    ``like`` gives dtype and device."""
    rows = step.grad_rows[0]
    if rows == 0:
        return []
    if not arriving and len(grads) == 1 and _covers(grads[0][2], rows) and grads[0][0].dtype == like.dtype:
        return [g.contiguous() for g in grads[0][:2]]  # the first contribution covers every row: send it as it is
    if arriving and arriving[0].shape[1] == rows:
        total = arriving
    else:
        shape = (like.shape[0], rows, *like.shape[2:])
        total = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
        if arriving:
            add_rows(total[0], step.grad_grow, arriving[0])
            add_rows(total[1], step.grad_grow, arriving[1])
    for dk_b, dv_b, target in grads:
        add_grad(total[0], dk_b, target)
        add_grad(total[1], dv_b, target)
    return total
