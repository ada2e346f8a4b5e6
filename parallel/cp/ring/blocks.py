"""What the ring's backward steps pass around (the ring engine's named tuples; the kernels' are in
``parallel/kernels/contract.py``).

Shapes as in ``forward.py``: a step sees the query rows of one head chunk, in the plan's rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cp_train.parallel.cp.plan.segments import Interval


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
