"""What the ring's backward steps pass around (the ring engine's named tuples; the kernels' are in
``parallel/kernels/contract.py``).

Shapes as in ``forward.py``: a step sees the query rows of one head chunk, in the plan's rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cp_train.parallel.cp.plan.rank_plan import StepPlan
from cp_train.parallel.cp.plan.segments import Interval


def cover(parts: list[Interval], total: int) -> bool:
    """Whether ``parts`` (sorted) are back to back from 0 to ``total``."""
    end = 0
    for start, stop in parts:
        if start != end:
            return False
        end = stop
    return end == total


def tiles(step: StepPlan, rows: int, keys: int) -> bool:
    """Whether ``step``'s dense calls write each of its ``rows`` query rows and each of its ``keys`` dK/dV rows
    once (packed documents at cp 1: a causal call per document): their outputs then need no accumulator."""
    return (cover(sorted(c.segment.q for c in step.calls), rows)
            and cover(sorted(c.grad_kv for c in step.calls), keys))


class SavedRows(NamedTuple):
    """The query rows a backward step reads: ``dout``, ``q`` and the forward's final ``out`` ``[B, n, h, D]``,
    and its final ``lse`` ``[B, n, h]`` (the accumulator layout, rows first: a kernel call transposes its part
    to the kernel's ``[B, h, m]``)."""

    dout: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


class BlockGrads(NamedTuple):
    """One kernel call's dK and dV and where they add into the block's dK/dV accumulator: ``target`` is an
    interval of its rows (dim 1) for a dense call, or an index tensor into the flattened ``[B * rows]``
    accumulator for a varlen call (``backward.add_grad``)."""

    dk: torch.Tensor
    dv: torch.Tensor
    target: Interval | torch.Tensor
