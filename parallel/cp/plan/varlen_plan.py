"""The index tensors of a ring step's varlen calls (``ring/varlen_steps.py``), built with the plan.

A step of many segments runs on a GPU as at most two varlen calls (one causal, one not). Their index
tensors are built once per step for one sample (``step_varlen``), on the CPU, and travel with the plan
(``RankPlan.pin_memory`` / ``RankPlan.to``), so a forward never copies them from the host. A batch of ``B``
unpacked samples derives its indices on the tensors' device (``batched``): device arithmetic, no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cp_train.parallel.cp.plan.segments import Interval, Segment
from cp_train.parallel.kernels.contract import VarlenSegments

MANY_CALLS = 3  # a step of at least this many dense calls runs as varlen calls where the spec asks for them


@dataclass(frozen=True)
class VarlenCall:
    """One varlen call: ``q_index`` rows of the flattened ``[B*n]`` queries, ``kv_index`` of the flattened held
    K/V store, ``grad_index`` of the flattened dK/dV accumulator; ``segments`` as the kernel takes them."""

    causal: bool
    q_index: torch.Tensor
    kv_index: torch.Tensor
    grad_index: torch.Tensor
    segments: VarlenSegments

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> VarlenCall:
        """This call with ``fn`` applied to each of its index tensors (a move, a pin)."""
        seg = self.segments
        return VarlenCall(self.causal, fn(self.q_index), fn(self.kv_index), fn(self.grad_index),
                          VarlenSegments(fn(seg.cu_q), fn(seg.cu_k), seg.max_q, seg.max_k))


def step_varlen(segments: tuple[Segment, ...], grad_kv: tuple[Interval, ...]) -> tuple[VarlenCall, ...]:
    """The (at most two) varlen calls of a step's ``segments`` (``grad_kv`` their accumulator rows) for one
    sample (int64 indices, int32 ``cu``; CPU)."""
    calls = []
    for causal in (True, False):
        q_parts, kv_parts, grad_parts, lengths_q, lengths_k = [], [], [], [], []
        for segment, grad in zip(segments, grad_kv, strict=True):
            if segment.causal != causal:
                continue
            q_parts.append(torch.arange(*segment.q))
            kv_parts.append(torch.arange(*segment.kv))
            grad_parts.append(torch.arange(*grad))
            lengths_q.append(segment.rows)
            lengths_k.append(segment.keys)
        if not q_parts:
            continue
        cu = [torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
              for lengths in (lengths_q, lengths_k)]
        calls.append(VarlenCall(causal, *(torch.cat(p) for p in (q_parts, kv_parts, grad_parts)),
                                VarlenSegments(cu[0], cu[1], max(lengths_q), max(lengths_k))))
    return tuple(calls)


def batched(calls: tuple[VarlenCall, ...], batch: int, rows: int, held_rows: int, acc_rows: int
            ) -> tuple[VarlenCall, ...]:
    """``calls`` (one sample's) for ``batch`` samples of ``rows`` queries, sample after sample, computed on the
    calls' device (no host copy): the same indices a ``batch``-sample build gives."""
    if batch == 1:
        return calls
    out = []
    for call in calls:
        device = call.q_index.device
        step = torch.arange(batch, device=device).view(-1, 1)

        def tile(index: torch.Tensor, stride: int, step: torch.Tensor = step) -> torch.Tensor:
            return (index.view(1, -1) + step * stride).flatten()

        def cu(bounds: torch.Tensor, total: int, step: torch.Tensor = step) -> torch.Tensor:
            return torch.cat([bounds[:1], tile(bounds[1:], total, step.to(bounds.dtype))])

        seg = call.segments
        out.append(VarlenCall(call.causal, tile(call.q_index, rows), tile(call.kv_index, held_rows),
                              tile(call.grad_index, acc_rows),
                              VarlenSegments(cu(seg.cu_q, call.q_index.numel()), cu(seg.cu_k, call.kv_index.numel()),
                                             seg.max_q, seg.max_k)))
    return tuple(out)
