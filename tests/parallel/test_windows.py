"""Sliding windows and learned sinks through every CP algorithm x layout (spawned gloo worlds).

fp32 out, lse, dq, dk, dv and dsinks (summed over the CP ranks) against a float64 reference that builds the
full mask (same document, causal, window) with the sink as an extra column: W from 1 to beyond S, windows
across chunk and document boundaries, one-token documents, GQA, with and without ``build_cp_plan``. One world
per size runs many cases (``tests/window_cases.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cp_train.parallel.cp.attention import build_cp_plan, context_parallel_attention
from cp_train.parallel.cp.dropins import zigzag_ring_flash_attn_func
from cp_train.parallel.cp.layout import LAYOUTS
from cp_train.parallel.cp.plan.segments import Window
from cp_train.parallel.cp.plan.window_plan import as_window, flash_window
from cp_train.parallel.mesh.state import run_with_parallel
from tests import window_cases

TOL = 1e-6
SEQLEN = {1: 24, 2: 24, 3: 24, 4: 32, 8: 32}
WINDOWS = (1, 2, 3, 5, 7, 13, 40)  # 40 > S: no window in effect
SPECS = (None, "random", "single_tokens", "chunk_bounds")


def cases(layouts: tuple[str, ...], heads: int, kv_heads: int, stride: int) -> list[tuple]:
    """Every ``stride``-th (layout, causal, window, spec) with sinks and ``plan=`` alternating."""
    grid = list(itertools.product(layouts, (True, False), WINDOWS, SPECS))
    chosen = grid[::stride] + [(layout, True, w, "random") for layout in layouts for w in (4, 9)]
    return [(layout, causal, heads, kv_heads, spec, window, n % 2 == 0, n % 3 == 0)
            for n, (layout, causal, window, spec) in enumerate(chosen)]


def run(spawn_world, world: int, algorithm: str, case_list: list[tuple], ulysses: int = 1) -> None:
    """The cases in calls of at most 16 (each call answers well within the spawned world's timeout)."""
    for start in range(0, len(case_list), 16):
        part = case_list[start:start + 16]
        errors = spawn_world(world).run(run_with_parallel, (1, world, 1, ulysses), window_cases.check_window_cases,
                                        algorithm, part, SEQLEN[world])
        failures = {case: error for case, error in zip(part, errors[0], strict=True) if not error <= TOL}
        assert not failures, failures
        assert errors[0] == errors[-1], "ranks disagree"


def test_windows_and_sinks_cp1_cp2_cp3(spawn_world) -> None:
    run(spawn_world, 1, "ring", cases(("contiguous",), 4, 2, 2))
    for algorithm in ("ring", "allgather", "ulysses"):
        run(spawn_world, 2, algorithm, cases(LAYOUTS, 4, 2, 9))
    for algorithm in ("ring", "allgather"):
        run(spawn_world, 3, algorithm, cases(LAYOUTS, 4, 2, 11))


def test_windows_and_sinks_cp4(spawn_world) -> None:
    for algorithm, ulysses in (("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)):
        run(spawn_world, 4, algorithm, cases(LAYOUTS, 4, 2, 7), ulysses)


def test_windows_and_sinks_cp8(spawn_world) -> None:
    chosen = [("zigzag", True, 8, 2, spec, window, True, window == 5)
              for window, spec in ((1, None), (3, "random"), (5, "single_tokens"), (40, None))]
    chosen.append(("balanced", True, 8, 2, "random", 5, True, False))
    for algorithm, ulysses in (("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)):
        run(spawn_world, 8, algorithm, chosen, ulysses)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_needle_at_the_window_edge_and_sinks_once(spawn_world, layout: str) -> None:
    """A key at distance W-1 is retrieved and one at W is not; the sink scale is applied exactly once (at every
    ring step it would scale by sigmoid^P)."""
    world = spawn_world(4)
    for window in (3, 8, 13):
        inside, outside = world.run(run_with_parallel, (1, 4, 1), window_cases.needle, layout, window, 32)[0]
        assert inside > 0.999 and outside == 0.0, (window, inside, outside)
    assert world.run(run_with_parallel, (1, 4, 1), window_cases.sinks_once, layout, 32)[0] <= TOL


def test_halo_exchange_moves_rows_in_proportion_to_the_window(spawn_world) -> None:
    """Zigzag with a window receives its halo both ways (2 (W-1) rows, not the one-way ring's relay), the
    contiguous ring only its left halo; the plan's count is what travels."""
    world = spawn_world(4)
    for layout, window, most in (("zigzag", 5, 2 * 4), ("contiguous", 5, 4), ("zigzag", 12, 2 * 11)):
        counted, sent = zip(*world.run(run_with_parallel, (1, 4, 1), window_cases.halo_rows, layout, window, 64),
                            strict=True)
        assert max(counted) <= most, (layout, window, counted)
        assert sent[0] <= 1.01 * sum(counted) / 4 + 1, (layout, window, counted, sent)


def test_window_plans_and_bad_input() -> None:
    plan = build_cp_plan(None, "zigzag", True, 16, window=4)
    assert plan.window == Window(3, 0) and plan.ring.steps[0].segments
    q = torch.randn(1, 16, 4, 8)
    with pytest.raises(ValueError, match="sinks must be a \\[heads\\] = \\[4\\] tensor"):
        context_parallel_attention(q, q, q, None, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="built for window"):
        context_parallel_attention(q, q, q, None, plan=plan, window=5)
    with pytest.raises(ValueError, match="W >= 1 keys"):
        context_parallel_attention(q, q, q, None, window=0)
    assert as_window((-1, -1), True) is None and as_window((3, -1), False) == Window(3, None)
    assert flash_window(Window(3, 0), True) == (3, 0) and flash_window(None, True) == (-1, 0)
    assert flash_window(as_window(1, True), True) == (0, 0)  # never a negative computed left


def test_dropin_window_size_matches_the_api() -> None:
    """flash-attn's window_size=(W-1, 0) through the drop-in equals window=W (one process, cp = 1)."""
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    ref = context_parallel_attention(q, k, v, None, "zigzag", True, window=5)
    out = zigzag_ring_flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
    assert torch.equal(out, ref)
    both = zigzag_ring_flash_attn_func(q, k, v, softmax_scale=window_cases.SCALE, causal=False,
                                       window_size=(2, 3))
    expect = window_cases.window_reference(q, k, v, torch.zeros_like(q), torch.zeros(1, 16, dtype=torch.long),
                                           False, (2, 3), None)["out"]
    assert window_cases.rel_err(both, expect) <= TOL


def test_operator_and_varlen_dropin_carry_window_and_sinks() -> None:
    """``cp_attention`` (the model's compiled path) with a window plan and sinks, and the varlen drop-in's
    window_size, equal ``context_parallel_attention`` (one process)."""
    from cp_train.parallel.cp.dropins_varlen import ring_flash_attn_varlen_func
    from cp_train.parallel.cp.op import cp_attention, plan_handle
    from cp_train.parallel.cp.spec import build_spec
    from cp_train.parallel.mesh.model_parallel import CPGroups

    q, k, v = (torch.randn(1, 16, 4, 8, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    plan = build_cp_plan(None, "contiguous", True, 16, window=6)
    spec = build_spec(q.device, q.dtype, 1, 4, 4, 8, layout="contiguous", plan=plan)
    out = cp_attention(q, k, v, plan_handle(CPGroups(None), spec, plan), sinks)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    ref = context_parallel_attention(q, k, v, None, "contiguous", True, window=6, sinks=sinks)
    expect = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, expect, strict=True))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    packed = ring_flash_attn_varlen_func(q[0], k[0], v[0], cu, 11, causal=True, window_size=(2, 0))
    docs = torch.tensor([[0] * 5 + [1] * 11])
    alone = context_parallel_attention(q, k, v, None, "contiguous", True, window=3, document_ids=docs)
    assert window_cases.rel_err(packed, alone[0]) <= TOL


@pytest.mark.parametrize("version", ["2.5.9", "2.6.3", "2.7.4.post1", "2.8.3", "fa3:plain", "fa3:custom_op"])
def test_kernel_window_call_forms(version: str) -> None:
    """flash-attn 2.5/2.6 take ``window_size=(left, right)``, 2.7-2.8 and FA3 two ints (stand-ins with each
    release's signatures); no window leaves the calls as they were. Forward and backward bind."""
    from cp_train.parallel.kernels.contract import BackwardRows
    from cp_train.parallel.kernels.flash_attn import FlashAttn2, FlashAttn3
    from tests import fa3_standins
    from tests import flash_attn_standins as standins

    if version.startswith("fa3"):
        kernel, calls = FlashAttn3.load(fa3_standins.fa3_interface(version[4:])), fa3_standins.CALLS
    else:
        kernel, calls = FlashAttn2.load(standins.flash_attn_interface(version), version), standins.CALLS
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    for window in (None, (3, 0)):
        calls.clear()
        out, lse = kernel.forward(q, k, v, True, 0.25, window=window)
        kernel.backward(BackwardRows(q, q, out, lse), k, v, True, 0.25, window=window)
        recorded = calls[0].get("window", calls[0].get("window_size"))
        assert recorded in (None, window or (-1, -1)), (version, recorded)
    assert kernel.native_window


def test_ulysses_gives_the_window_to_a_kernel_that_takes_one(spawn_world) -> None:
    """With a kernel that takes flash-attn's window (flash-attn, FA3, PyTorch's CUDA flash), Ulysses on one
    document makes one windowed call over the whole sequence per head chunk, exact with sinks."""
    for window in (1, 5, 40):
        errors = spawn_world(2).run(run_with_parallel, (1, 2, 1), window_cases.check_native_window, window, 24)
        assert max(errors) <= TOL, (window, errors)
