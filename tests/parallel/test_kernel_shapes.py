"""The dense kernel shapes packed documents give, and the copies a varlen step makes (CPU; the GPU's path).

cuDNN builds an execution graph per dense shape (forward and backward apart) and never evicts one, so the
ring's dense calls must not take their shapes from the documents: the steps the documents shape run as varlen
calls (``route_by_documents``). ``NativeVarlen`` stands in for a GPU kernel with varlen calls: the ring runs
its varlen path on CPU (gathers, slices, merges) while the kernel records every dense shape it is given.
"""

from __future__ import annotations

import pytest
import torch

from bench.cudnn_graphs import lognormal_documents
from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.cp.plan import varlen_plan
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents
from cp_train.parallel.cp.plan.routing import layout_shapes
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from cp_train.parallel.kernels.varlen import backward_by_segments, forward_by_segments
from tests.dispatch_count import OpCounter
from tests.document_cases import inputs, masked_reference
from tests.numerics import rel_err
from tests.ring_threads import run_threaded_ring

MICRO_BATCHES, SETTLED = 40, 20
INDEX_OPS = ("index_select", "index_copy", "index_add", "index_put", "index.Tensor", "gather", "scatter")


class NativeVarlen:
    """The CPU flash kernel with varlen calls of its own (emulated per segment, unrecorded): records the shape
    ``(query rows, key rows, causal)`` of every dense call the ring makes, and counts the varlen calls."""

    name = "native varlen stand-in"
    native_varlen = True

    def __init__(self) -> None:
        self.inner, self.shapes, self.varlen_calls = TorchCpuFlash(), set(), 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
        self.shapes.add((q.shape[1], k.shape[1], causal))
        return self.inner.forward(q, k, v, causal, scale)

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
        self.shapes.add((rows.q.shape[1], k.shape[1], causal))
        return self.inner.backward(rows, k, v, causal, scale)

    def varlen_forward(self, q, k, v, segments: VarlenSegments, causal: bool, scale: float):  # noqa: ANN001
        self.varlen_calls += 1
        return forward_by_segments(self.inner, q, k, v, segments, causal, scale)

    def varlen_backward(self, rows: BackwardRows, k, v, segments: VarlenSegments, causal: bool,  # noqa: ANN001
                        scale: float):
        self.varlen_calls += 1
        return backward_by_segments(self.inner, rows, k, v, segments, causal, scale)


def positions_in_documents(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document piece ``[B, S]``."""
    index = torch.arange(docs.shape[1]).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first


def rank_plans(docs: torch.Tensor, world: int, layout: str = "zigzag") -> list:
    """Every rank's plan for one sample ``docs`` ``[S]`` in ``layout``."""
    seqlen = docs.shape[0]
    positions = positions_in_documents(docs[None])[0]
    order = [sequence_positions(seqlen, rank, world, layout) for rank in range(world)]
    every_docs = torch.stack([docs[o] for o in order])[:, None]
    every_positions = torch.stack([positions[o] for o in order])[:, None]
    return [plan_for_documents(every_docs, every_positions, rank, True) for rank in range(world)]


def _shapes(plan, routed: bool = True) -> set[tuple[int, int, bool]]:  # noqa: ANN001 - a RankPlan
    """The dense shapes of ``plan``'s steps not routed to varlen calls (``routed`` False: of every step)."""
    return {(c.segment.rows, c.segment.keys, c.segment.causal) for step in plan.steps
            if not (routed and step.by_documents) for c in step.calls}


@pytest.mark.parametrize("world", [1, 4])
def test_packed_documents_keep_the_dense_shapes_few(world: int) -> None:
    """40 micro-batches of 2,048 tokens of lognormal documents: every dense shape is one of the layout's block
    shapes (``layout_shapes``: at most 5 per rank whatever the documents; one cuDNN graph each, built the
    first time the shape comes), so no document shape is new after micro-batch 20 and the distinct shapes stay
    at most 8; every call of every step as a dense call (the ring before the routing) gives a new document
    shape in most micro-batches, after micro-batch 20 too."""
    docs = lognormal_documents(2048, MICRO_BATCHES, seed=world)
    seen: list[set] = [set() for _ in range(world)]
    unrouted: list[set] = [set() for _ in range(world)]
    late = 0  # document shapes first given after micro-batch 20, without the routing
    n = 2048 // world
    for number, sample in enumerate(docs):
        for rank, plan in enumerate(rank_plans(sample, world)):
            shapes, every = _shapes(plan), _shapes(plan, routed=False)
            assert {s[:2] for s in shapes} <= layout_shapes(n), f"micro-batch {number}: {shapes}"
            late += number >= SETTLED and bool({s for s in every - unrouted[rank] if s[:2] not in layout_shapes(n)})
            seen[rank] |= shapes
            unrouted[rank] |= every
    for rank in range(world):
        assert len(seen[rank]) <= 8
        assert len(unrouted[rank]) > 30  # the control: the documents' own shapes
    assert late >= 10


@pytest.mark.parametrize("world", [1, 4])
def test_the_varlen_path_is_exact_and_gives_the_kernel_those_shapes(world: int) -> None:
    """The ring over thread ranks with a varlen kernel: the kernel sees only layout shapes as dense calls and
    the results match the float64 reference of the per-document mask."""
    seqlen = 256
    q, k, v, dout = inputs(seqlen, 4, 2, seed=world)
    docs = lognormal_documents(seqlen, 2, seed=10 + world, median=48)
    kernel = NativeVarlen()
    spec = AttentionSpec("ring", "zigzag", True, 0.25, kernel, 2, True, varlen=True)
    got = run_threaded_ring(q, k, v, dout, world, spec, docs)
    want = masked_reference(q, k, v, dout, docs, True, 0.25)
    for name, value in want.items():
        assert rel_err(got[name], value) <= 2e-6, name
    assert kernel.varlen_calls > 0
    assert {s[:2] for s in kernel.shapes} <= layout_shapes(seqlen // world)


def _index_ops(stretches: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The index ops (gathers, scatters) one forward and backward of the ring at cp 1 issues with packed
    documents (``stretches`` False: every index an index tensor, as before the slices), and its out and dq."""
    seqlen = 128
    q, k, v, dout = inputs(seqlen, 4, 2, seed=3)
    docs = lognormal_documents(seqlen, 2, seed=4, median=24)
    plan = plan_for_documents(docs[None], positions_in_documents(docs)[None], 0, True)
    assert plan.packed and all(step.by_documents for step in plan.steps)
    spec = AttentionSpec("ring", "contiguous", True, 0.25, NativeVarlen(), 1, True, varlen=True)
    original = varlen_plan.stretch
    if not stretches:
        varlen_plan.stretch = lambda index: index
    try:
        counter = _IndexOps()
        with counter:
            out, lse = ring_forward(q, k, v, None, spec, plan)
            dq, _, _ = ring_backward(dout, q, k, v, out, lse, None, spec, plan)
    finally:
        varlen_plan.stretch = original
    return counter.index_ops, out, dq


class _IndexOps(OpCounter):
    """Counts the gathers and scatters (``INDEX_OPS``) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.index_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if any(name in str(func) for name in INDEX_OPS):
            self.index_ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_no_index_ops_at_cp1() -> None:
    """At cp 1 every varlen index is the identity: no gather, no scatter, the kernel's outputs handed over;
    with index tensors instead (the control) the same step gathers and scatters, with the same results."""
    ops, out, dq = _index_ops(stretches=True)
    control, out_control, dq_control = _index_ops(stretches=False)
    assert ops == 0 and control >= 10
    assert torch.equal(out, out_control) and torch.equal(dq, dq_control)


@pytest.mark.parametrize("documents,varlen", [(True, True), (False, True), (True, False)])
def test_cp1_hands_over_the_kernels_own_dtype(documents: bool, varlen: bool) -> None:
    """At cp 1 nothing merges into the local step's outputs: in bf16 out, dq, dk and dv stay the kernel's bf16
    (they were cast to fp32 and back: two copies a layer forward, three backward, 22 ms of an H200's 1B step),
    lse stays fp32; packed documents as one varlen call, as one dense call per document (a kernel without varlen
    calls: ``cudnn_ragged``, the CPU's) and one document as one dense call alike; the values match the float64
    reference to bf16's precision."""
    seqlen = 128
    q, k, v, dout = (x[:1].bfloat16() for x in inputs(seqlen, 4, 2, seed=5))  # one sample, as the GPU configs
    docs = lognormal_documents(seqlen, 1, seed=6, median=24) if documents else torch.zeros(1, seqlen, dtype=torch.long)
    plan = plan_for_documents(docs[None], positions_in_documents(docs)[None], 0, True)
    assert plan.world == 1 and all(step.by_documents for step in plan.steps) == documents
    kernel = NativeVarlen() if varlen else TorchCpuFlash()
    spec = AttentionSpec("ring", "contiguous", True, 0.25, kernel, 1, True, varlen=varlen)
    assert varlen or len(plan.steps[0].calls) > 1
    out, lse = ring_forward(q, k, v, None, spec, plan)
    grads = ring_backward(dout, q, k, v, out, lse, None, spec, plan)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    want = masked_reference(q.double(), k.double(), v.double(), dout.double(), docs, True, 0.25)
    for name, value in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True):
        assert rel_err(value.double(), want[name]) <= 1e-2, name
