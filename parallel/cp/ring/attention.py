"""Ring attention with autograd: this rank's queries against every K/V block of the ring.

``ring_call(q, k, v, group, spec, plan, sinks)`` gives the Function that runs ``forward.py``'s forward and
``backward.py``'s backward over ``group`` with ``plan`` (a ``RankPlan``; None: no ring and one document, a
single kernel call each way), with learned ``sinks`` ``[H]`` applied once after the merge
(``sinks.py``). The public entry point is ``cp_train.parallel.cp.attention.context_parallel_attention``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.plan.rank_plan import RankPlan
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.comm import RingComm
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.sinks import apply_sinks, sink_grad
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import BackwardRows


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, spec: AttentionSpec, plan: RankPlan | None, sinks=None):
        comm = RingComm(group) if group is not None and dist.get_world_size(group) > 1 else None
        plan = None if plan is None else plan.on_device(q.device)  # itself when moved ahead (``RankPlan.to``)
        if plan is None:
            out, lse = spec.kernel.forward(q, k, v, spec.causal, spec.scale)  # lse [B, H, n]
        else:
            out, lse = ring_forward(q, k, v, comm, spec, plan)
            lse = lse.transpose(1, 2)
        if sinks is not None:
            apply_sinks(out, lse.transpose(1, 2), sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.comm, ctx.spec, ctx.plan = comm, spec, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        spec = ctx.spec
        dsinks = sink_grad(dout, out, lse.transpose(1, 2), sinks[0]) if sinks else None
        if ctx.plan is None:
            dq, dk, dv = spec.kernel.backward(BackwardRows(dout, q, out, lse), k, v, spec.causal, spec.scale)
        else:
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse.transpose(1, 2), ctx.comm, spec, ctx.plan)
        dq, dk, dv = dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)  # each its own: no copy where it is q's already
        return dq, dk, dv, None, None, None, dsinks


def ring_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
              spec: AttentionSpec, plan: RankPlan | None, sinks: torch.Tensor | None = None
              ) -> tuple[type[torch.autograd.Function], tuple]:
    """The autograd Function of the ring and its ``apply`` arguments (``cp_train.parallel.cp.attention_call``)."""
    return _RingAttention, (q, k, v, group, spec, plan, sinks)

