"""The index tensors of a ring step's varlen calls (``ring/varlen_steps.py``), built with the plan.

A step whose calls the documents shape (``StepPlan.by_documents``) runs on a GPU as at most two varlen calls
(one causal, one not). Their indices are built once per step for one sample (``step_varlen``), on the CPU, and
travel with the plan (``RankPlan.pin_memory`` / ``RankPlan.to``), so a forward never copies them from the host.
An index that is one stretch of rows is a ``slice`` (a view: nothing gathered, nothing scattered; at cp 1 every
index is the identity). A batch of ``B`` unpacked samples derives its indices on the tensors' device
(``batched``): device arithmetic, no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cp_train.parallel.cp.plan.device import Selector, apply_rows
from cp_train.parallel.cp.plan.segments import Interval, Segment
from cp_train.parallel.kernels.contract import VarlenSegments


@dataclass(frozen=True)
class VarlenCall:
    """One varlen call: ``q_index`` rows of the flattened ``[B*n]`` queries, ``kv_index`` of the flattened held
    K/V store, ``grad_index`` of the flattened dK/dV accumulator (each a slice when one stretch, else an int64
    tensor); ``segments`` as the kernel takes them."""

    causal: bool
    q_index: Selector
    kv_index: Selector
    grad_index: Selector
    segments: VarlenSegments

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> VarlenCall:
        """This call with ``fn`` applied to each of its index tensors (a move, a pin)."""
        seg = self.segments
        return VarlenCall(self.causal, apply_rows(self.q_index, fn), apply_rows(self.kv_index, fn),
                          apply_rows(self.grad_index, fn), VarlenSegments(fn(seg.cu_q), fn(seg.cu_k), seg.max_q,
                                                                          seg.max_k))

    def covers(self, rows: int) -> bool:
        """Whether the call's queries are all ``rows`` rows, in order."""
        return self.q_index == slice(0, rows)


def stretch(index: torch.Tensor) -> Selector:
    """``index`` as a slice when it is one stretch of consecutive rows, else itself."""
    if index.numel() and int(index[-1]) - int(index[0]) + 1 == index.numel() and bool(
            (index[1:] - index[:-1] == 1).all()):
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


def count(index: Selector) -> int:
    """The rows ``index`` picks (no device read)."""
    return index.stop - index.start if isinstance(index, slice) else index.numel()


def _pieces(segment: Segment, grad: Interval) -> list[tuple[Segment, Interval]]:
    """``segment`` (and its accumulator rows ``grad``) as varlen segments: itself, or a sliding run of one-key
    rows (one-token documents, no window) row by row."""
    if not segment.slide:
        return [(segment, grad)]
    if segment.keys - segment.rows + 1 != 1 or not segment.causal:
        raise ValueError(f"a varlen call takes no sliding-window segment ({segment}); run the step's dense calls")
    offset = grad[0] - segment.kv[0]
    return [(Segment((q, q + 1), (k, k + 1), False), (k + offset, k + offset + 1))
            for q, k in zip(range(*segment.q), range(*segment.kv), strict=True)]


def step_varlen(segments: tuple[Segment, ...], grad_kv: tuple[Interval, ...]) -> tuple[VarlenCall, ...]:
    """The (at most two) varlen calls of a step's ``segments`` (``grad_kv`` their accumulator rows) for one
    sample (int64 indices or slices, int32 ``cu``; CPU)."""
    pieces = [piece for segment, grad in zip(segments, grad_kv, strict=True) for piece in _pieces(segment, grad)]
    calls = []
    for causal in (True, False):
        chosen = [(segment, grad) for segment, grad in pieces if segment.causal == causal]
        if not chosen:
            continue
        lengths_q, lengths_k = [s.rows for s, _ in chosen], [s.keys for s, _ in chosen]
        cu = [torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
              for lengths in (lengths_q, lengths_k)]
        index = [stretch(torch.cat([torch.arange(*part) for part in parts]))
                 for parts in ([s.q for s, _ in chosen], [s.kv for s, _ in chosen], [g for _, g in chosen])]
        calls.append(VarlenCall(causal, *index, VarlenSegments(cu[0], cu[1], max(lengths_q), max(lengths_k))))
    return tuple(calls)


def batched(calls: tuple[VarlenCall, ...], batch: int, rows: int, held_rows: int, acc_rows: int
            ) -> tuple[VarlenCall, ...]:
    """``calls`` (one sample's) for ``batch`` samples of ``rows`` queries, sample after sample, computed on the
    calls' device (no host copy): the same indices a ``batch``-sample build gives (an identity stays a slice)."""
    if batch == 1:
        return calls
    out = []
    for call in calls:
        device = call.segments.cu_q.device
        step = torch.arange(batch, device=device).view(-1, 1)

        def tile(index: Selector, stride: int, step: torch.Tensor = step, device: torch.device = device) -> Selector:
            if isinstance(index, slice):
                if index == slice(0, stride):
                    return slice(0, batch * stride)
                index = torch.arange(index.start, index.stop, device=device)
            return (index.view(1, -1) + step * stride).flatten()

        def cu(bounds: torch.Tensor, total: int, step: torch.Tensor = step) -> torch.Tensor:
            return torch.cat([bounds[:1], (bounds[1:].view(1, -1) + step.to(bounds.dtype) * total).flatten()])

        seg = call.segments
        out.append(VarlenCall(call.causal, tile(call.q_index, rows), tile(call.kv_index, held_rows),
                              tile(call.grad_index, acc_rows),
                              VarlenSegments(cu(seg.cu_q, count(call.q_index)), cu(seg.cu_k, count(call.kv_index)),
                                             seg.max_q, seg.max_k)))
    return tuple(out)
