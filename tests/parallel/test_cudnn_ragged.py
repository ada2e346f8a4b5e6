"""The ``cudnn_ragged`` backend on CPU: packed documents as dense cuDNN calls on views, the graphs PyTorch's ragged
dense path would build for them (one per power-of-two length), exactness through the ring, and the trial that
admits it (through the schema-checking stand-ins of ``test_kernels_cudnn``; the device's own run is in tests/gpu).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from bench import cudnn_graphs
from bench.cudnn_graphs import lognormal_documents
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels import cudnn, cudnn_ragged
from cp_train.parallel.kernels.cudnn import CudnnAttention
from cp_train.parallel.kernels.cudnn_ragged import graph_key, power_of_two
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from tests.document_cases import inputs, masked_reference
from tests.numerics import rel_err
from tests.parallel.test_kernel_shapes import MICRO_BATCHES, SETTLED, positions_in_documents, rank_plans
from tests.parallel.test_kernel_warmup import _args
from tests.parallel.test_kernels_cudnn import standin_backward, standin_forward
from tests.ring_threads import run_threaded_ring

CPU = torch.device("cpu")


class Recorded:
    """The stand-in ops, recording the graph key of every call as PyTorch's ragged path would key it."""

    def __init__(self, backward=standin_backward) -> None:  # noqa: ANN001 - an op stand-in
        self.keys: list[tuple] = []
        self._backward = backward

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the op's own signature
        q, k, v = (args[i].transpose(1, 2) for i in range(3))
        self.keys.append(graph_key("forward", args[6], q, k, v))
        return standin_forward(*args, **kwargs)

    def backward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        q, k, v = (args[i].transpose(1, 2) for i in (1, 2, 3))
        self.keys.append(graph_key("backward", args[14], q, k, v))
        return self._backward(*args, **kwargs)


@pytest.fixture
def recorded(monkeypatch) -> Recorded:
    ops = Recorded()
    monkeypatch.setattr(cudnn, "FORWARD", ops.forward)
    monkeypatch.setattr(cudnn, "BACKWARD", ops.backward)
    return ops


def test_lengths_round_to_powers_of_two_on_packed_rows_only() -> None:
    """Row slices of a packed block share a key within a power of two; a head chunk's view (not ``[B, S, H, D]``
    contiguous) keys on its exact shape, as the ordinary dense path does."""
    assert [power_of_two(n) for n in (0, 1, 2, 3, 300, 512, 513)] == [1, 1, 2, 4, 512, 512, 1024]
    block = torch.zeros(1, 1024, 8, 16)
    rows = [block[:, 10:10 + n] for n in (300, 400, 512)]
    assert len({graph_key("forward", True, x, x, x) for x in rows}) == 1
    assert graph_key("forward", True, rows[0], rows[0], rows[0]) != graph_key("forward", True, *[block[:, :600]] * 3)
    heads = [block[:, :n, :4] for n in (300, 400)]
    assert len({graph_key("forward", True, x, x, x) for x in heads}) == 2


def _ragged_keys(plan) -> set[tuple]:  # noqa: ANN001 - a RankPlan
    """The (direction, causal, rows bucket, keys bucket) of every dense call of ``plan`` (nothing routed)."""
    return {(kind, c.segment.causal, power_of_two(c.segment.rows), power_of_two(c.segment.keys))
            for step in plan.steps for c in step.calls for kind in ("forward", "backward")}


@pytest.mark.parametrize("world", [1, 4])
def test_documents_as_dense_calls_build_few_graphs(world: int) -> None:
    """40 micro-batches of 2,048 tokens of lognormal documents, every step's calls dense (one per document piece):
    their exact shapes are new in most micro-batches (the control: over 30, and new after micro-batch 20), their
    ragged graphs are bounded by the powers of two: at most 2 x 12 at cp 1 (a causal square per power of two up to
    2,048, each direction; 16 measured) and 2 x 24 per rank at cp 4 (36-44 measured). A bucket first met late
    still builds its graph then (once per run, not once per document shape)."""
    docs = lognormal_documents(2048, MICRO_BATCHES, seed=world)
    keys: list[set] = [set() for _ in range(world)]
    exact: list[set] = [set() for _ in range(world)]
    late_exact = 0
    for number, sample in enumerate(docs):
        for rank, plan in enumerate(rank_plans(sample, world)):
            keys[rank] |= _ragged_keys(plan)
            shapes = {(c.segment.rows, c.segment.keys, c.segment.causal) for s in plan.steps for c in s.calls}
            late_exact += number >= SETTLED and bool(shapes - exact[rank])
            exact[rank] |= shapes
    assert late_exact >= 10
    for rank in range(world):
        assert len(keys[rank]) <= (24 if world == 1 else 48), sorted(keys[rank])
        assert len(exact[rank]) > 30


@pytest.mark.parametrize("world", [1, 4])
def test_the_ring_on_ragged_cudnn_is_exact_and_calls_those_graphs(recorded: Recorded, world: int) -> None:
    """The ring over thread ranks (head chunks 2: the backward's views are copied to ``[B, S, H, D]``) with packed
    documents on cuDNN with ragged graphs: no varlen call, every op call's key a power-of-two one of the plans'
    calls or the warm-up's, and the results match the float64 reference of the per-document mask."""
    seqlen = 256
    q, k, v, dout = inputs(seqlen, 4, 2, seed=20 + world)
    docs = lognormal_documents(seqlen, 2, seed=30 + world, median=48)
    kernel = CudnnAttention(varlen_kernel=None, ragged_graphs=True)
    assert not kernel.native_varlen
    spec = AttentionSpec("ring", "zigzag", True, 0.25, kernel, 2, True, varlen=kernel.native_varlen)
    got = run_threaded_ring(q, k, v, dout, world, spec, docs)
    want = masked_reference(q, k, v, dout, docs, True, 0.25)
    for name, value in want.items():
        assert rel_err(got[name], value) <= 2e-6, name
    assert recorded.keys and all(key[0] == "ragged" for key in recorded.keys), "every call on packed rows"
    planned = set().union(*(_ragged_keys(plan) for sample in docs for plan in rank_plans(sample, world)))
    planned |= {(kind, c.causal, power_of_two(c.rows), power_of_two(c.keys)) for kind in ("forward", "backward")
                for c in warm.calls(spec, seqlen // world, world)}  # the ring's warm-up calls
    assert {(key[1], key[2], *key[-1]) for key in recorded.keys} <= planned


def _warm_keys(spec: AttentionSpec, rows: int, world: int) -> set[tuple]:
    """The (direction, causal, rows bucket, keys bucket) of the ring's warm-up calls."""
    return {(kind, c.causal, power_of_two(c.rows), power_of_two(c.keys)) for kind in ("forward", "backward")
            for c in warm.calls(spec, rows, world)}


def _rectangles_spec(layout: str) -> AttentionSpec:
    """cudnn_ragged with a varlen kernel (the CPU's by-segment one here): the documents' full pieces go to it."""
    kernel = CudnnAttention(varlen_kernel=TorchCpuFlash(), ragged_graphs=True)
    assert kernel.varlen_rectangles and not kernel.native_varlen
    return AttentionSpec("ring", layout, True, 0.25, kernel, 2, True, varlen=False, rectangles=True)


@pytest.mark.parametrize(("world", "layout"), [(4, "zigzag"), (8, "zigzag"), (4, "stripe"), (4, "contiguous")])
def test_full_pieces_on_varlen_leave_only_graphs_the_warm_up_builds(world: int, layout: str) -> None:
    """Above cp 1 a document's pieces on two ranks pair any two powers of two (36-44 graphs per rank at cp 4,
    some first met late). With the full pieces as one varlen call per step, every dense call of 40 micro-batches
    (the documents' causal squares, the layout's block shapes) is one the ring's warm-up makes."""
    spec, rows = _rectangles_spec(layout), 2048 // world
    warmed = _warm_keys(spec, rows, world)
    full_pieces = 0
    for sample in lognormal_documents(2048, MICRO_BATCHES, seed=world):
        for plan in rank_plans(sample, world, layout):
            for step in plan.steps:
                dense = [c for c in step.calls if not (step.by_documents and not c.segment.causal)]
                full_pieces += len(step.calls) - len(dense)
                keys = {(kind, c.segment.causal, power_of_two(c.segment.rows), power_of_two(c.segment.keys))
                        for c in dense for kind in ("forward", "backward")}
                assert keys <= warmed, sorted(keys - warmed)
    assert len(warmed) <= 2 * 12 and (full_pieces > 100 or layout == "stripe")  # stripe's pieces: causal


@pytest.mark.parametrize(("layout", "causal"), [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_the_ring_with_full_pieces_on_varlen_is_exact(recorded: Recorded, monkeypatch, layout: str,
                                                       causal: bool) -> None:
    """cp 4 over thread ranks, packed documents: the causal squares on cuDNN's ragged graphs (the stand-in ops),
    the full pieces on the varlen kernel, merged into the same rows; the results match float64 and every cuDNN
    call is one of the warm-up's graphs. Without a causal mask every piece is full: the local step's varlen call
    writes the rows first."""
    varlen: list[bool] = []  # each varlen call's causal flag

    def counting(real):  # noqa: ANN001, ANN202 - wraps a kernel method
        def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            varlen.append(args[-2])
            return real(self, *args, **kwargs)
        return counted

    for name in ("varlen_forward", "varlen_backward"):
        monkeypatch.setattr(TorchCpuFlash, name, counting(getattr(TorchCpuFlash, name)))
    world, seqlen = 4, 256
    q, k, v, dout = inputs(seqlen, 4, 2, seed=50)
    docs = lognormal_documents(seqlen, 2, seed=51, median=48)
    spec = dataclasses.replace(_rectangles_spec(layout), causal=causal)
    warm.forget()
    got = run_threaded_ring(q, k, v, dout, world, spec, docs)
    want = masked_reference(q, k, v, dout, docs, causal, 0.25)
    for name, value in want.items():
        assert rel_err(got[name], value) <= 2e-6, name
    assert {(key[1], key[2], *key[-1]) for key in recorded.keys} <= _warm_keys(spec, seqlen // world, world)
    assert len(varlen) > 10 and not any(varlen), "the full pieces went to the varlen kernel, and only they"
    assert any(key[2] for key in recorded.keys) == causal  # the causal squares on cuDNN


def _heads_major_only(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the op's signature
    """A build whose backward reads lse's memory as ``[B, H, Sq]`` whatever its strides."""
    args = list(args)
    lse = args[5]
    args[5] = torch.as_strided(lse, lse.shape, (lse.shape[1] * lse.shape[2], lse.shape[2], 1, 1))
    return standin_backward(*args, **kwargs)


def _clock(shared: float, building: float):  # noqa: ANN202
    times = iter([0.0, shared, 0.0, building])
    return lambda: next(times)


@pytest.mark.parametrize("backward,rows_major", [(standin_backward, True), (_heads_major_only, False)])
def test_the_trial_picks_the_lse_layout_the_build_reads(monkeypatch, backward, rows_major: bool) -> None:
    ops = Recorded(backward)
    monkeypatch.setattr(cudnn, "FORWARD", ops.forward)
    monkeypatch.setattr(cudnn, "BACKWARD", ops.backward)
    kernel = cudnn_ragged.trial(CudnnAttention(), CPU, torch.float32, 16, clock=_clock(0.001, 0.05))
    assert kernel.name == "cudnn_ragged" and kernel.ragged_graphs and kernel.lse_rows_major is rows_major
    assert not kernel.native_varlen


def test_the_trial_refuses_inexact_calls_and_a_graph_per_length(monkeypatch, recorded: Recorded) -> None:
    with pytest.raises(RuntimeError, match="TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 must be set before"):
        cudnn_ragged.trial(CudnnAttention(), CPU, torch.float32, 16, clock=_clock(0.04, 0.05))

    def wrong(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        dq, dk, dv = standin_backward(*args, **kwargs)
        return dq * 1.5, dk, dv

    monkeypatch.setattr(cudnn, "BACKWARD", wrong)
    with pytest.raises(RuntimeError, match="not exact here.*dq"):
        cudnn_ragged.trial(CudnnAttention(), CPU, torch.float32, 16, clock=_clock(0.001, 0.05))


def test_enable_sets_pytorchs_switch(monkeypatch) -> None:
    monkeypatch.delenv(cudnn_ragged.SWITCH, raising=False)
    cudnn_ragged.enable()
    assert os.environ[cudnn_ragged.SWITCH] == "1"


def test_the_warm_up_builds_every_bucket_a_document_meets_at_cp1(recorded: Recorded) -> None:
    """cp 1, a new sample of lognormal documents per micro-batch (as the 1B profile's steps): the ring's warm-up
    calls a causal square of every power of two below the block besides the block, so every graph key the
    documents' calls meet is first seen in the first micro-batch."""
    seqlen = 512
    q, k, v, dout = (x[:1] for x in inputs(seqlen, 4, 2, seed=40))
    kernel = CudnnAttention(varlen_kernel=None, ragged_graphs=True)
    spec = AttentionSpec("ring", "contiguous", True, 0.25, kernel, 1, True, varlen=False)
    warm.forget()
    first_seen: dict[tuple, int] = {}
    for number, docs in enumerate(lognormal_documents(seqlen, 6, seed=41, median=40)):
        plan = plan_for_documents(docs[None, None], positions_in_documents(docs[None])[None], 0, True)
        out, lse = ring_forward(q, k, v, None, spec, plan)
        ring_backward(dout, q, k, v, out, lse, None, spec, plan)
        for key in recorded.keys:
            first_seen.setdefault(key, number)
        assert len(plan.steps[0].calls) > 3
    assert first_seen and set(first_seen.values()) == {0}


@pytest.mark.parametrize(("layout", "world"), [("contiguous", 1), ("zigzag", 4)])
def test_the_graphs_bench_counts_ragged_keys(recorded: Recorded, layout: str, world: int) -> None:
    """``bench.cudnn_graphs`` on a kernel with ragged graphs (a new sample of lognormal documents per step): its keys
    rounded as PyTorch's ragged path rounds them (a handful of powers of two, not one per document shape), every one
    first seen at step 1 (the warm-up); at cp 4 with the full pieces on the varlen kernel."""
    args = _args(layout, world, no_warm=False)
    kernel = CudnnAttention(varlen_kernel=TorchCpuFlash() if world > 1 else None, ragged_graphs=True)
    summary = cudnn_graphs.run(args, kernel=kernel)[-1]
    assert summary["kernel"] == "cudnn" and 0 < summary["keys"] <= 2 * 11 * world and summary["new_after_step_1"] == 0
    assert {key[0] for key in recorded.keys} == {"ragged"}
