"""The layout's dense kernel shapes, run once per thread before a rank's first real call, on kernels that build a
plan per shape (``kernel.plans_per_shape``: cuDNN builds an execution graph per call shape and strides, forward
and backward apart, in a thread-local cache that never evicts; no API fills it but a call on that thread).

With packed documents the steps the documents shape run as varlen calls (``route_by_documents``), so the dense
calls a rank issues are the layout's block shapes (``layout_shapes``) on two kinds of K/V store: the rank's own
block and a received one. Which of them a rank meets first depends on the data (a block wholly inside one
document is rare), so without this a graph is built at some late step, on one rank at a time, while the ring
waits for it. ``needed`` says when a thread meets a new signature (the tensors' heads, head dim, strides past
the batch and dtype, the rows per rank, the kernel); the forward and backward then call every shape once through
their own call functions on views of the call's own tensors, so the warm calls' keys are the real calls'; the
results are dropped. On other kernels nothing runs.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from cp_train.parallel.cp.plan.routing import layout_shapes
from cp_train.parallel.cp.plan.segments import Segment
from cp_train.parallel.cp.spec import AttentionSpec

ENABLED = True  # bench/cudnn_graphs.py --no-warm measures the graphs built without it
_seen = threading.local()


def shapes(rows: int, world: int, layout: str, causal: bool) -> list[Segment]:
    """The dense calls a rank of ``world`` with ``rows`` rows can make in ``layout`` (one document's steps, which
    are the dense steps of any documents: ``route_by_documents``), from row and key 0. One rank: the whole block;
    zigzag: the causal block and its halves against whole blocks; stripe: the causal block and the one a row
    short; contiguous: the causal block and a whole earlier one; balanced: every ``layout_shapes`` shape. Without
    a causal mask every call is a full one."""
    squares = {(rows, rows): (True,)} if causal else {(rows, rows): (False,)}
    if world > 1 and layout == "zigzag" and rows % 2 == 0:
        squares.update({(rows // 2, rows): (False,), (rows, rows // 2): (False,)})
    elif world > 1 and layout == "stripe" and causal:
        squares[rows - 1, rows - 1] = (True,)
    elif world > 1 and layout == "contiguous" and causal:
        squares[rows, rows] = (True, False)
    elif world > 1 and layout not in ("zigzag", "stripe", "contiguous"):
        squares = {shape: ((True, False) if causal and shape[0] == shape[1] else (False,))
                   for shape in layout_shapes(rows)}
    return [Segment((0, m), (0, n), flag) for (m, n), flags in sorted(squares.items()) if m > 0 and n > 0
            for flag in flags]


def calls(spec: AttentionSpec, rows: int, world: int) -> list[Segment]:
    """The warm-up's calls for ``spec``: the layout's ``shapes``; with a kernel on ragged graphs (``cudnn_ragged``:
    one graph per power-of-two length, its documents' causal squares run as dense calls, their full pieces as
    varlen calls with ``spec.rectangles``) also a causal square of each power of two from 2 below ``rows``, so that
    a document of any length meets a built graph."""
    found = shapes(rows, world, spec.layout, spec.causal)
    if spec.causal and getattr(spec.kernel, "ragged_graphs", False):
        found += [Segment((0, 1 << i), (0, 1 << i), True) for i in range(1, (rows - 1).bit_length())]
    return found


def needed(spec: AttentionSpec, rows: int, *parts: torch.Tensor | Hashable) -> bool:
    """Whether this thread has not yet warmed ``spec``'s kernel for ``rows`` rows per rank and ``parts`` (tensors:
    their layout; anything else as it is), marked warmed on return; False on kernels without per-shape plans."""
    if not ENABLED or not getattr(spec.kernel, "plans_per_shape", False):
        return False
    key = (id(spec.kernel), spec.scale, rows, *(
        (x.shape[0], *x.shape[2:], *x.stride()[1:], x.dtype) if isinstance(x, torch.Tensor) else x for x in parts))
    seen = getattr(_seen, "keys", None)
    if seen is None:
        seen = _seen.keys = set()
    if key in seen:
        return False
    seen.add(key)
    return True


def forget() -> None:
    """Forget what this thread warmed (a test's stand-in for a fresh process)."""
    _seen.keys = set()


def received_like(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zeros shaped as a received K/V block of ``rows`` rows (the ring's receive buffers are contiguous)."""
    return torch.zeros(x.shape[0], rows, *x.shape[2:], dtype=x.dtype, device=x.device)
