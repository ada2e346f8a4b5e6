"""The ring attention backward pipeline (no autograd; see attention.py; shapes, plans and head chunks
as in forward.py).

Backward: the local step first, over every head at once (its kernel outputs become dq, dk, dv) while
the first head chunk's K/V hop travels; then the remote steps, one head chunk (``spec.head_chunks``) at
a time, which bounds the transient buffers (received K/V, travelling dK/dV) to one chunk's size. The
dK/dV accumulator of a block starts on the first rank that uses it, travels the ring with the K/V,
grows by the rows each rank touches and arrives home at the block's owner, which adds it to its own
share. dQ stays local. Nothing saved is recomputed. Buffers are dropped as soon as they are sent.

Overlap policy (``AttentionSpec.overlap``, ``spec.default_overlap``): at a chunk boundary two
hops have no kernel call of their own chunk to hide behind, the chunk's last dK/dV hop home and the
next chunk's first K/V hop. Without ``overlap`` (CPU with one document, where memory is the tighter
budget and every rank's steps are equal) both travel together and are waited for in place. With it
(GPUs; CPU with packed documents) the next chunk's K/V hop is posted before the chunk's last remote step
and the dK/dV hop lands after the next chunk's first remote step, so both travel during compute and
ranks whose steps differ in length wait only for the totals, at the price of one more K/V and one more
dK/dV buffer alive at a time.
"""

from __future__ import annotations

import torch

from cp_train.parallel.cp.plan.device import Selector
from cp_train.parallel.cp.plan.rank_plan import RankPlan, StepPlan
from cp_train.parallel.cp.plan.segments import Interval, Segment
from cp_train.parallel.cp.ring import varlen_steps as ring_varlen
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.cp.ring.blocks import BlockGrads, SavedRows
from cp_train.parallel.cp.ring.comm import GRAD_TAG, RingComm, Transfer
from cp_train.parallel.cp.ring.forward import (
    add_rows,
    head_chunk_bounds,
    one_call,
    pass_kv,
    plan_rows,
    running,
    split_rectangles,
    unmerged,
    uses_varlen,
)
from cp_train.parallel.cp.ring.varlen_steps import flat_view, varlen_calls
from cp_train.parallel.cp.ring.varlen_steps import whole_call as varlen_whole
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import BackwardRows, QKVGrads, accumulator_dtype


def add_grad(total: torch.Tensor, part: torch.Tensor, target: Interval | torch.Tensor) -> None:
    """Add one call's dK (or dV) to an accumulator: rows ``target`` (an interval of dim 1), or the rows of
    the flattened ``[B*rows]`` accumulator a varlen call names (an index tensor)."""
    if isinstance(target, tuple):
        total[:, target[0]:target[1]] += part
    else:
        flat_view(total).index_add_(0, target, part.to(total.dtype))


def _covers(target: Interval | torch.Tensor, rows: int) -> bool:
    """Whether one call's gradient rows are all ``rows`` of the accumulator, in order."""
    return isinstance(target, tuple) and target == (0, rows)


def step_grads(plan: RankPlan, index: int, rows: SavedRows, held: list[torch.Tensor], dq: torch.Tensor,
               spec: AttentionSpec) -> list[BlockGrads]:
    """One step's backward: adds its dq share into ``dq``; returns each kernel call's ``BlockGrads``.

    ``rows`` are the chunk's query heads; ``held`` the [k, v] store of the step.
    """
    step = plan.steps[index]
    if uses_varlen(spec, step):
        calls = varlen_calls(plan, index, rows.q.shape[0], rows.q.shape[1], dq.device)
        return ring_varlen.backward_step(spec.kernel, calls, rows, held, dq, spec.scale)
    dense, rectangles = split_rectangles(spec, plan, index, rows.q)
    grads = []
    for call in dense:
        dq_b, dk_b, dv_b = call_backward(spec, call.segment, rows, held)
        dq[:, slice(*call.segment.q)] += dq_b
        grads.append(BlockGrads(dk_b, dv_b, call.grad_kv))
    if rectangles:
        grads += ring_varlen.backward_step(spec.kernel, rectangles, rows, held, dq, spec.scale)
    return grads


def call_backward(spec: AttentionSpec, segment: Segment, rows: SavedRows, held: list[torch.Tensor]) -> QKVGrads:
    """One dense kernel call's dq (its query rows) and dk, dv (its key rows of the [k, v] store ``held``)."""
    part, keys = slice(*segment.q), slice(*segment.kv)
    grad = BackwardRows(rows.dout[:, part], rows.q[:, part], rows.out[:, part], rows.lse[:, part].transpose(1, 2))
    k, v = held[0][:, keys], held[1][:, keys]
    if segment.slide:  # an inverted triangle: the causal call on rows and keys reversed (``call_forward``)
        grad = BackwardRows(*(x.flip(1) for x in grad[:3]), grad.lse.flip(2))
        dq, dk, dv = spec.kernel.backward(grad, k.flip(1), v.flip(1), True, spec.scale)
        return dq.flip(1), dk.flip(1), dv.flip(1)
    return spec.kernel.backward(grad, k, v, segment.causal, spec.scale)


def _land(homecoming: list[tuple[Transfer, torch.Tensor, torch.Tensor]], home: Selector) -> None:
    """Wait for each chunk's dK/dV accumulator arriving home and add it to the chunk's own (dk, dv)."""
    for transfer, dk_c, dv_c in homecoming:
        arrived = transfer.wait()
        if arrived:
            add_rows(dk_c, home, arrived[0])
            add_rows(dv_c, home, arrived[1])
    homecoming.clear()


def local_grads(plan: RankPlan, rows: SavedRows, held: list[torch.Tensor], dq_c: torch.Tensor,
                dk_c: torch.Tensor, dv_c: torch.Tensor, spec: AttentionSpec) -> None:
    """The local step: dq, dk, dv of the chunk's own block, written straight into the outputs."""
    dq_c.zero_()
    grads = step_grads(plan, 0, rows, held, dq_c, spec)
    if len(grads) == 1 and _covers(grads[0].target, dk_c.shape[1]):  # one call over every row: copy, no zeroing
        dk_c.copy_(grads[0].dk)
        dv_c.copy_(grads[0].dv)
        return
    dk_c.zero_()
    dv_c.zero_()
    for grad in grads:
        add_grad(dk_c, grad.dk, grad.target)
        add_grad(dv_c, grad.dv, grad.target)


def local_step(plan: RankPlan, rows: SavedRows, held: list[torch.Tensor], spec: AttentionSpec) -> QKVGrads:
    """The local step over every head: new dq, dk, dv accumulators, contiguous (``rows`` and ``held`` as in
    ``step_grads``). One call over every row hands over the kernel's own outputs (``running``: no copy when they
    are contiguous in the accumulator dtype; without remote steps, ``plan.world`` 1, nothing adds into them and
    they stay in the kernel's dtype)."""
    q, k = rows.q, held[0]
    acc = accumulator_dtype(q.dtype)
    handed = acc if plan.world > 1 else q.dtype  # the dtype of the outputs one call hands over
    step = plan.steps[0]
    if one_call(spec, step, q.shape[1]) and _covers(step.calls[0].grad_kv, k.shape[1]):
        dq, dk, dv = call_backward(spec, step.calls[0].segment, rows, held)
        return running(dq, handed), running(dk, handed), running(dv, handed)
    call = varlen_whole(plan, 0, q.shape[0], q.shape[1], q.device) if uses_varlen(spec, step) else None
    if call is not None:
        dq, grads = ring_varlen.whole_backward(spec.kernel, call, rows, held, spec.scale)
        if _covers(grads.target, k.shape[1]):
            return running(dq, handed), running(grads.dk, handed), running(grads.dv, handed)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        add_grad(dk, grads.dk, grads.target)
        add_grad(dv, grads.dv, grads.target)
        return running(dq, handed), dk, dv
    if unmerged(spec, plan, q.shape[1], k.shape[1]):
        return _unmerged_grads(spec, step, rows, held)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty_like(dk)
    local_grads(plan, rows, held, dq, dk, dv, spec)
    return dq, dk, dv


def _unmerged_grads(spec: AttentionSpec, step: StepPlan, rows: SavedRows, held: list[torch.Tensor]) -> QKVGrads:
    """dq, dk, dv of a local step whose dense calls write each row once (``forward.unmerged``): each call's
    gradients copied into place, in the kernel's dtype (no zeroing, no fp32 accumulator)."""
    q, k = rows.q, held[0]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk, dv = (torch.empty(k.shape, dtype=k.dtype, device=k.device) for _ in range(2))
    for call in step.calls:
        dq_b, dk_b, dv_b = call_backward(spec, call.segment, rows, held)
        keys = slice(*call.grad_kv)
        dq[:, slice(*call.segment.q)] = dq_b
        dk[:, keys] = dk_b
        dv[:, keys] = dv_b
    return dq, dk, dv


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, comm: RingComm | None, spec: AttentionSpec, plan: RankPlan) -> QKVGrads:
    """Backward over the ring: dq [B, n, H, D], dk, dv [B, n, Hk, D] in the accumulator dtype (at ``plan.world`` 1
    a local step of one call, or of calls that write each row once: the kernel's own, ``local_step``).

    The local step runs first over every head while the first head chunk's K/V hop travels (its kernel
    outputs become dq, dk, dv); then each head chunk's remote steps add into them. At a chunk boundary the
    next chunk's first K/V hop travels with this chunk's last dK/dV hop home; with ``spec.overlap`` it is
    posted before the chunk's last remote step instead, and that dK/dV hop lands after the next chunk's
    first remote step, so every hop overlaps a kernel call."""
    q_shape, kv_shape = q.shape, k.shape
    plan = plan.on_device(q.device)
    dout, q, k, v, out, lse = (plan_rows(x, plan) for x in (dout, q, k, v, out, lse))
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    group_size = heads // kv_heads
    chunks = head_chunk_bounds(kv_heads, spec.head_chunks) if comm is not None else []

    def chunk_rows(k0: int, k1: int) -> SavedRows:
        qs = slice(k0 * group_size, k1 * group_size)
        dout_c = dout[:, :, qs]
        if batch == 1 and not dout_c.is_contiguous():  # the CPU kernel copies a strided dout in every call
            dout_c = dout_c.contiguous()
        return SavedRows(dout_c, q[:, :, qs], out[:, :, qs], lse[:, :, qs])

    def first_hop(k0: int, k1: int) -> Transfer:
        return pass_kv(comm, [k[:, :, k0:k1], v[:, :, k0:k1]], plan.steps[0], k[:, :, k0:k1])

    kv_transfer = first_hop(*chunks[0]) if chunks else None
    if warm.needed(spec, q_shape[1], dout, q, out, k, v):
        warm_backward(spec, SavedRows(dout, q, out, lse), [k, v], plan.world, q_shape[1])
    dq, dk, dv = local_step(plan, SavedRows(dout, q, out, lse), [k, v], spec)
    homecoming: list[tuple[Transfer, torch.Tensor, torch.Tensor]] = []  # dK/dV hops still travelling home
    for number, (k0, k1) in enumerate(chunks):
        rows = chunk_rows(k0, k1)
        if warm.needed(spec, q_shape[1], rows.dout, rows.q, rows.out, ("received", k1 - k0)):
            received = [warm.received_like(x[:, :, k0:k1], q_shape[1]) for x in (k, v)]
            warm_backward(spec, rows, received, plan.world, q_shape[1])
        dq_c, dk_c, dv_c = dq[:, :, k0 * group_size:k1 * group_size], dk[:, :, k0:k1], dv[:, :, k0:k1]
        following = chunks[number + 1] if number + 1 < len(chunks) else None
        grad_transfer = None
        for index in range(1, plan.world):
            step = plan.steps[index]
            held = kv_transfer.wait()
            if index + 1 < plan.world:
                kv_transfer = pass_kv(comm, held, step, k[:, :, k0:k1])
            elif following is not None and spec.overlap:  # the next chunk's first hop travels during this step
                kv_transfer = first_hop(*following)
            grads = step_grads(plan, index, rows, held, dq_c, spec)
            del held
            if index == 1 and spec.overlap:
                _land(homecoming, plan.home)  # the previous chunk's last dK/dV hop travelled during this step
            arriving = grad_transfer.wait() if grad_transfer is not None else []
            accumulator = _accumulate(arriving, step, grads, dk_c)
            del arriving, grads
            # pass the accumulator on; after the last hop every accumulator arrives at its owner
            recv_rows = step.grad_rows[1]
            shapes = [(batch, recv_rows, k1 - k0, dim)] * 2 if recv_rows else []
            grad_transfer = comm.exchange(accumulator, shapes, tag=GRAD_TAG, like=dk_c)
            del accumulator
        homecoming.append((grad_transfer, dk_c, dv_c))
        if following is not None and not spec.overlap:  # travels with the dK/dV hop: one wait for both
            kv_transfer = first_hop(*following)
        if not spec.overlap:
            _land(homecoming, plan.home)
    _land(homecoming, plan.home)
    return dq.reshape(q_shape[:3] + (dim,)), dk.reshape(kv_shape[:3] + (dim,)), dv.reshape(kv_shape[:3] + (dim,))


def warm_backward(spec: AttentionSpec, rows: SavedRows, held: list[torch.Tensor], world: int, sample_rows: int
                  ) -> None:
    """Every layout shape of ``sample_rows`` rows per sample once (``warm.shapes``) through ``call_backward`` on
    ``rows`` and the K/V store ``held``; the gradients are dropped."""
    for segment in warm.calls(spec, sample_rows, world):
        call_backward(spec, segment, rows, held)


def _accumulate(arriving: list[torch.Tensor], step: StepPlan, grads: list[BlockGrads], like: torch.Tensor
                ) -> list[torch.Tensor]:
    """The travelling [dk, dv] accumulator after this step: the arriving one (rows of earlier ranks, placed by
    ``step.grad_grow``) plus this rank's calls, in ``step.grad_rows[0]`` rows (empty: nothing to send).
    ``like`` gives dtype and device."""
    rows = step.grad_rows[0]
    if rows == 0:
        return []
    if not arriving and len(grads) == 1 and _covers(grads[0].target, rows) and grads[0].dk.dtype == like.dtype:
        return [grads[0].dk.contiguous(), grads[0].dv.contiguous()]  # the first contribution covers every row
    if arriving and arriving[0].shape[1] == rows:
        total = arriving
    else:
        shape = (like.shape[0], rows, *like.shape[2:])
        total = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
        if arriving:
            add_rows(total[0], step.grad_grow, arriving[0])
            add_rows(total[1], step.grad_grow, arriving[1])
    for grad in grads:
        add_grad(total[0], grad.dk, grad.target)
        add_grad(total[1], grad.dv, grad.target)
    return total
