"""Ring attention on spawned CPU gloo worlds: exactness, bf16, causal skipping, bad input."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.dropins import zigzag_ring_flash_attn_func
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, sequence_positions
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents, plan_for_layout
from cp_train.parallel.cp.plan.varlen_plan import VarlenCall, batched, step_varlen
from cp_train.parallel.cp.ring.backward import _accumulate
from cp_train.parallel.cp.ring.blocks import BlockGrads
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import BackwardRows
from cp_train.parallel.kernels.select import MathKernel, select_kernel
from tests import ring_cases
from tests.numerics import rel_err
from tests.ring_threads import run_threaded_ring

TOL = 1e-5
# (world, local chunk length) pairs: chunks 13 and 6 are not powers of two.
CASES = [(w, layout, causal, heads, chunk)
         for w in (1, 2, 3, 4)
         for layout in STATIC_LAYOUTS
         for causal in (True, False)
         for heads in ((4, 4), (4, 2))
         for chunk in ((13,) if w == 3 else (8, 13))]
ERRORS: dict[tuple, dict[int, float]] = {}


@pytest.mark.parametrize("world,layout,causal,heads,chunk", CASES)
def test_ring_fp32_matches_float64_reference(spawn_world, world, layout, causal, heads, chunk) -> None:
    seqlen = 2 * world * chunk
    use_api = chunk == 13  # the ring-flash-attn compatible functions on half the cases
    errors = spawn_world(world).run(ring_cases.check_fp32, seqlen, *heads, layout, causal, use_api)
    worst = {name: max(e[name] for e in errors) for name in errors[0]}
    assert max(worst.values()) <= TOL, worst
    ERRORS.setdefault((layout, causal, heads, chunk), {})[world] = max(worst.values())


@pytest.mark.parametrize("head_chunks", [1, 2, 3])
def test_head_chunking_is_exact(spawn_world, head_chunks: int) -> None:
    errors = spawn_world(2).run(ring_cases.check_fp32, 24, 6, 3, "zigzag", True, False, head_chunks)
    assert max(max(e.values()) for e in errors) <= TOL


@pytest.mark.parametrize("world,layout,head_chunks", [(2, "zigzag", None), (2, "zigzag", 3), (3, "contiguous", 2)])
def test_forward_runs_in_one_head_chunk_unless_asked(spawn_world, world: int, layout: str,
                                                     head_chunks: int | None) -> None:
    """By default the ring's forward makes one call per slice of its plan; ``head_chunks`` given chunks it
    too, exactly (and the backward: test_causal_blocks_are_skipped)."""
    results = spawn_world(world).run(ring_cases.check_forward_chunks, 12 * world, 6, 3, layout, True, head_chunks)
    for rank, got in enumerate(results):
        assert max(got["out"], got["lse"]) <= TOL, got
        per_pass = sum(len(step.calls) for step in plan_for_layout(layout, True, world, rank, 12).steps)
        assert got["calls"] == (head_chunks or 1) * per_pass, (rank, got)


@pytest.mark.parametrize("world,layout,head_chunks", [(2, "zigzag", 1), (2, "zigzag", 3), (4, "contiguous", 2),
                                                      (4, "stripe", 3), (3, "zigzag", 2)])
def test_gpu_overlap_policy_is_exact(spawn_world, world: int, layout: str, head_chunks: int) -> None:
    """The GPU policy (first K/V hop before the local step, last dK/dV hop landing after the next chunk's
    local step) computes the same gradients, whatever the chunking."""
    for causal in (True, False):
        errors = spawn_world(world).run(ring_cases.check_fp32, 12 * world, 6, 3, layout, causal, False, head_chunks,
                                        16, 4, True)
        assert max(max(e.values()) for e in errors) <= TOL


def test_error_does_not_grow_with_world_size(spawn_world) -> None:
    """The same problem at cp = 1, 2, 4, 8: the ring's error stays at the local kernel's level."""
    errors = {}
    for world in (1, 2, 4, 8):
        per_rank = spawn_world(world).run(ring_cases.check_fp32, 96, 4, 2, "zigzag", True, False, None, 16, 5)
        errors[world] = max(max(e.values()) for e in per_rank)
    assert max(errors.values()) <= TOL, errors
    assert max(errors.values()) <= 2.0 * errors[1] + 1e-7, errors
    for key, by_world in ERRORS.items():  # and across every case above that ran at several world sizes
        if 1 in by_world:
            assert max(by_world.values()) <= 2.0 * by_world[1] + 1e-7, (key, by_world)


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (4, "zigzag"), (4, "stripe"), (2, "contiguous")])
def test_bf16_within_twice_the_local_kernel_error(spawn_world, world: int, layout: str) -> None:
    results = spawn_world(world).run(ring_cases.check_bf16, 64 * world, 4, 2, layout, True)
    for name, (ring, local) in results[0].items():
        assert ring <= 2.0 * local, f"{name}: ring bf16 error {ring:.2e} vs local kernel {local:.2e}"


@pytest.mark.parametrize("layout", STATIC_LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_causal_blocks_are_skipped(spawn_world, layout: str, causal: bool) -> None:
    world, chunks = 4, 2
    counts = spawn_world(world).run(ring_cases.count_kernel_calls, 32, 4, 2, layout, causal, chunks)
    for rank, got in enumerate(counts):
        steps = plan_for_layout(layout, causal, world, rank, 8).steps
        local, remote = len(steps[0].calls), sum(len(step.calls) for step in steps[1:])
        # the backward's local step takes every head at once; the remote steps run per head chunk
        assert got == {"forward": chunks * (local + remote), "backward": local + chunks * remote}, (rank, got)
    total = sum(c["forward"] for c in counts)
    if causal and layout == "contiguous":
        assert [c["forward"] for c in counts] == [chunks * (1 + r) for r in range(world)]
    elif causal:  # balanced: every rank makes one call per step
        assert all(c["forward"] == chunks * world for c in counts)
    assert total == chunks * (world * (world + 1) // 2 if causal and layout == "contiguous" else world**2)


def test_bad_inputs_raise_with_a_message() -> None:
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        context_parallel_attention(q, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8), None)
    with pytest.raises(ValueError, match="must agree in batch, local seqlen"):
        context_parallel_attention(q, torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8), None)
    with pytest.raises(ValueError, match="must have the same shape"):
        context_parallel_attention(q, q, torch.randn(1, 8, 2, 8), None)
    with pytest.raises(ValueError, match="needs a floating dtype"):
        context_parallel_attention(q.long(), q.long(), q.long(), None)
    with pytest.raises(ValueError, match="dtypes differ"):
        context_parallel_attention(q, q.double(), q, None)
    with pytest.raises(ValueError, match=r"must be \[batch, seqlen, heads, head_dim\]"):
        context_parallel_attention(q[0], q[0], q[0], None)
    with pytest.raises(ValueError, match=r"even local sequence length.*multiple of 2\*cp"):
        context_parallel_attention(q[:, :7], q[:, :7], q[:, :7], None, layout="zigzag")
    with pytest.raises(ValueError, match="unknown CP layout"):
        context_parallel_attention(q, q, q, None, layout="spiral")
    with pytest.raises(ValueError, match="unknown attention backend"):
        context_parallel_attention(q, q, q, None, backend="nonesuch")
    for kwargs, word in (({"dropout_p": 0.1}, "dropout_p"), ({"alibi_slopes": torch.ones(4)}, "alibi_slopes")):
        with pytest.raises(NotImplementedError, match=word):
            zigzag_ring_flash_attn_func(q, q, q, **kwargs)
    with pytest.raises(ValueError, match=r"window_size=\(4, 2\) looks right of the query"):
        zigzag_ring_flash_attn_func(q, q, q, causal=True, window_size=(4, 2))


def test_single_process_is_the_local_kernel() -> None:
    """Without a process group the API is the plain local kernel (cp = 1), with gradients."""
    q, k, v = (torch.randn(1, 12, 2, 8, requires_grad=True) for _ in range(3))
    out, lse, _ = zigzag_ring_flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                           is_causal=True).transpose(1, 2)
    assert rel_err(out, ref) < 1e-6 and lse.shape == (1, 2, 12)
    (dq,) = torch.autograd.grad(out.square().sum(), q)
    (dq_ref,) = torch.autograd.grad(ref.square().sum(), q)
    assert rel_err(dq, dq_ref) < 1e-5


def test_transfers_carry_only_the_rows_still_needed() -> None:
    n, world = 8, 4

    def sent(layout: str, causal: bool, rank: int) -> list[int]:  # K/V rows sent after each step
        return [step.kv_rows[0] for step in plan_for_layout(layout, causal, world, rank, n).steps]

    def carried(layout: str, causal: bool, rank: int) -> list[int]:  # dK/dV rows sent after each step
        return [step.grad_rows[0] for step in plan_for_layout(layout, causal, world, rank, n).steps]

    # zigzag: block 0 only ever meets higher ranks, which read its first half
    assert sent("zigzag", True, 0)[0] == n // 2
    assert sent("zigzag", True, 2)[:2] == [n, n]  # rank 3 reads half, ranks 0, 1 all of it
    # contiguous causal: nobody after the last rank needs its block, so that hop is skipped
    assert sent("contiguous", True, world - 1)[0] == 0
    assert sent("contiguous", True, 0)[0] == n and sent("contiguous", True, 1)[1] == n
    assert sent("stripe", True, 3)[0] == n - 1
    assert sent("zigzag", False, 0)[0] == n
    # the travelling dK/dV covers the rows used so far: block 1 after rank 2 (half), after ranks 2, 3, 0 (all)
    assert carried("zigzag", True, 2)[1] == n // 2 and carried("zigzag", True, 0)[3] == n
    assert carried("contiguous", True, 0)[1] == 0  # block 3 is used by nobody after rank 3


def _index_tensors(plan) -> list[torch.Tensor]:  # noqa: ANN001 - a RankPlan
    found = [plan.home, plan.send_index]
    for step in plan.steps:
        found += [step.kv_send, step.grad_grow]
        for call in step.varlen or ():
            found += [call.q_index, call.kv_index, call.grad_index, call.segments.cu_q, call.segments.cu_k]
    return [x for x in found if isinstance(x, torch.Tensor)]


def _indices(index) -> torch.Tensor:  # noqa: ANN001 - a Selector
    return torch.arange(index.start, index.stop) if isinstance(index, slice) else index


def _documents_plan(world: int = 4, n: int = 16, rank: int = 1, batch: int = 1):
    positions = torch.stack([sequence_positions(n * world, r, world, "zigzag") for r in range(world)])[:, None]
    positions = positions.expand(world, batch, n).contiguous()
    return plan_for_documents(torch.bucketize(positions, torch.tensor([5, 20, 23, 40, 51])), positions, rank, True)


def test_plan_moves_every_index_tensor_in_one_place() -> None:
    """Packed documents give index selectors and steps of many calls; ``to`` moves every index tensor at once
    (the varlen calls built first, for a GPU), ahead of the forward; on CPU the plan is itself, and a plan
    that was not moved is moved once by ``on_device`` (the fallback)."""
    plan = _documents_plan()
    before = _index_tensors(plan)
    assert before and any(step.by_documents for step in plan.steps)
    assert plan.to("cpu") is plan and plan.on_device(torch.device("cpu")) is plan
    moved = plan.to("meta", non_blocking=True)
    assert moved.device == torch.device("meta") and moved.to("meta") is moved
    assert moved.on_device(torch.device("meta")) is moved
    assert all(step.varlen for step in moved.steps if step.by_documents)
    assert all(x.device.type == "meta" for x in _index_tensors(moved))
    assert [step.calls for step in moved.steps] == [step.calls for step in plan.steps]
    fallback = plan.on_device(torch.device("meta"))
    assert fallback is plan.on_device(torch.device("meta")) and fallback.device == torch.device("meta")
    assert all(x.device.type == "cpu" for x in _index_tensors(plan)) and len(_index_tensors(plan)) == len(before)


def test_varlen_indices_of_a_batch_are_derived_on_the_device() -> None:
    """The varlen calls built for one sample give, for a batch of unpacked samples, exactly the indices a
    build over the whole batch gives (sample after sample)."""
    plan = _documents_plan(batch=3)
    assert not plan.packed
    for step in (s for s in plan.steps if s.by_documents):
        got = batched(step_varlen(step.segments, step.grad_kv), 3, plan.rows, step.held_rows, step.acc_rows)
        for call in got:
            parts = [(seg, grad) for seg, grad in zip(step.segments, step.grad_kv, strict=True)
                     if seg.causal == call.causal]
            call = VarlenCall(call.causal, *(_indices(x) for x in (call.q_index, call.kv_index, call.grad_index)),
                              call.segments)
            want_q = torch.cat([torch.arange(*seg.q) + b * plan.rows for b in range(3) for seg, _ in parts])
            want_kv = torch.cat([torch.arange(*seg.kv) + b * step.held_rows for b in range(3) for seg, _ in parts])
            want_grad = torch.cat([torch.arange(*grad) + b * step.acc_rows for b in range(3) for _, grad in parts])
            lengths = [seg.rows for _ in range(3) for seg, _ in parts], [seg.keys for _ in range(3) for seg, _ in parts]
            want_cu = [torch.tensor([0] + x).cumsum(0).to(torch.int32) for x in lengths]
            assert torch.equal(call.q_index, want_q) and torch.equal(call.kv_index, want_kv)
            assert torch.equal(call.grad_index, want_grad)
            assert torch.equal(call.segments.cu_q, want_cu[0]) and torch.equal(call.segments.cu_k, want_cu[1])
            assert call.segments.cu_q.dtype == torch.int32 and call.q_index.dtype == torch.int64


@pytest.mark.parametrize("uniform", [True, False])
def test_varlen_steps_match_dense_calls_on_cpu(uniform: bool) -> None:
    """The varlen path (the GPU's, its calls emulated per segment on CPU) against the dense calls, with a batch
    of equal samples (indices derived per batch) and of different ones (the batch folded)."""
    world, seqlen = 4, 64
    q, k, v, dout = ring_cases.full_inputs(seqlen, 4, 2, 16, seed=7)
    gen = torch.Generator().manual_seed(3)
    starts = torch.rand(2, seqlen, generator=gen) < 0.1
    starts[1] = starts[0] if uniform else starts[1]
    docs = torch.cumsum(starts.long(), 1)
    kernel = select_kernel(q.device, q.dtype, 16)
    dense = run_threaded_ring(q, k, v, dout, world, AttentionSpec("ring", "zigzag", True, 0.25, kernel, 2, True),
                              docs)
    varlen = run_threaded_ring(q, k, v, dout, world,
                               AttentionSpec("ring", "zigzag", True, 0.25, kernel, 2, True, varlen=True), docs)
    for name, value in dense.items():
        assert rel_err(varlen[name], value) <= TOL, name


def test_a_strided_first_accumulator_travels_contiguous() -> None:
    """The dK/dV a step sends on as the kernel returned them must be contiguous (NCCL refuses strided
    tensors; the float64 math kernel returns strided gradients)."""
    step = plan_for_layout("contiguous", False, 2, 0, 8).steps[1]
    assert step.grad_rows[0] == 8
    dk, dv = (torch.randn(1, 2, 8, 4, dtype=torch.float64).transpose(1, 2) for _ in range(2))  # [1, 8, 2, 4], strided
    sent = _accumulate([], step, [BlockGrads(dk, dv, (0, 8))], torch.empty(1, 8, 2, 4, dtype=torch.float64))
    assert all(x.is_contiguous() for x in sent)
    assert torch.equal(sent[0], dk) and torch.equal(sent[1], dv)


@pytest.mark.parametrize("world,layout,overlap", [(2, "zigzag", True), (4, "stripe", False), (3, "contiguous", True)])
def test_threaded_ring_harness_matches_the_reference(world: int, layout: str, overlap: bool) -> None:
    """The thread-rank harness the GPU suite uses for the ring's CUDA path, checked here on CPU."""
    q, k, v, dout = ring_cases.full_inputs(8 * world, 4, 2, 16, seed=6)
    spec = AttentionSpec("ring", layout, True, 0.25, select_kernel(q.device, q.dtype, 16), 2, overlap)
    got = run_threaded_ring(q, k, v, dout, world, spec)
    out, lse = MathKernel().forward(q, k, v, True, 0.25)
    grads = MathKernel().backward(BackwardRows(dout, q, out, lse), k, v, True, 0.25)
    ref = dict(zip(("dq", "dk", "dv"), grads, strict=True))
    ref.update(out=out, lse=lse)
    for name, value in ref.items():
        assert rel_err(got[name], value) <= TOL, name


def test_the_thread_harness_reports_a_failing_rank_without_waiting() -> None:
    """A rank whose kernel raises fails the run with its own error at once; its peers stop waiting for it
    (on the GPU a cuDNN refusal in one rank used to leave the others blocked until the test timed out)."""
    q, k, v, dout = ring_cases.full_inputs(32, 4, 2, 16, seed=7)
    base = select_kernel(q.device, q.dtype, 16)

    class RefusesBackward:
        name = "refuses backward"

        def forward(self, *args, **kwargs):
            return base.forward(*args, **kwargs)

        def backward(self, rows, *args, **kwargs):
            if threading.current_thread().name.endswith("-1"):
                raise RuntimeError("kernel refused this block")
            return base.backward(rows, *args, **kwargs)

    spec = AttentionSpec("ring", "zigzag", True, 0.25, RefusesBackward(), 2, True)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="kernel refused this block"):
        run_threaded_ring(q, k, v, dout, 4, spec)
    assert time.perf_counter() - started < 30
