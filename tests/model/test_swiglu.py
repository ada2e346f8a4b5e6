"""``model/mlp.py``'s ``swiglu``: the SwiGLU as one autograd node, silu recomputed in the backward.

Against a float64 reference by relative error; against autograd on the plain expression: the forward and the
weights' gradients bitwise in fp32 on CPU and under bf16 autocast, ``x``'s gradient (the sum in the second
matmul's epilogue) within 1e-6 and under autocast no further from float64; what autograd keeps (the weights
themselves, no silu, ``x`` once); compiled equals eager; the MLP calls it eager only and not for FP8 layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_train.model.mlp import MLP, swiglu
from tests.model_cases import tiny_config
from tests.numerics import rel_err

TOKENS, HIDDEN, FFN = 37, 64, 96


def two_matmuls(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w_gate, w_up = (torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
                       for shape in ((2, TOKENS, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN)))
    return x, w_gate, w_up, torch.randn(2, TOKENS, FFN, generator=g, dtype=dtype)


def _run(fn, x, w_gate, w_up, grad) -> tuple[torch.Tensor, ...]:
    y = fn(x, w_gate, w_up)
    return (y, *torch.autograd.grad(y, (x, w_gate, w_up), grad.to(y.dtype)))


def test_fp32_matches_float64_and_the_two_matmuls() -> None:
    x, w_gate, w_up, grad = _inputs()
    fused, unfused = _run(swiglu, x, w_gate, w_up, grad), _run(two_matmuls, x, w_gate, w_up, grad)
    reference = _run(two_matmuls, *(t.detach().double().requires_grad_() for t in (x, w_gate, w_up)), grad.double())
    for name, mine, ref in zip(("y", "dx", "dw_gate", "dw_up"), fused, reference, strict=True):
        assert rel_err(mine, ref) < 1e-6, (name, rel_err(mine, ref))
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[2], unfused[2]) and torch.equal(fused[3], unfused[3])
    assert rel_err(fused[1], unfused[1]) < 1e-6


def test_bf16_autocast_computes_in_bf16_and_is_no_further_from_float64() -> None:
    x, w_gate, w_up, grad = _inputs()
    with torch.autocast("cpu", torch.bfloat16):
        fused, unfused = _run(swiglu, x, w_gate, w_up, grad), _run(two_matmuls, x, w_gate, w_up, grad)
    reference = _run(two_matmuls, *(t.detach().double().requires_grad_() for t in (x, w_gate, w_up)), grad.double())
    assert fused[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in fused[1:])
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[2], unfused[2]) and torch.equal(fused[3], unfused[3])
    for mine, theirs, ref in zip(fused, unfused, reference, strict=True):
        assert rel_err(mine, ref) <= rel_err(theirs, ref) * 1.05 + 1e-6
        assert rel_err(mine, ref) < 2e-2


def test_keeps_the_weights_themselves_and_no_silu() -> None:
    x, w_gate, w_up, _ = _inputs()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(x, w_gate, w_up)
    assert [tuple(t.shape) for t in saved] == [(2, TOKENS, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN),
                                               (2, TOKENS, FFN), (2, TOKENS, FFN)]
    assert saved[0] is x and saved[1] is w_gate and saved[2] is w_up  # no copies: FSDP2 frees weights as a linear's
    unfused: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: unfused.append(t.numel()) or t, lambda t: t):
        two_matmuls(x, w_gate, w_up)
    # the two matmuls save x twice (one tensor in fp32; under autocast a cast each) and silu(gate) besides
    assert sum(unfused) - sum(t.numel() for t in saved) == x.numel() + 2 * TOKENS * FFN


def test_compiled_equals_eager() -> None:
    x, w_gate, w_up, grad = _inputs(seed=1)
    eager = _run(swiglu, x, w_gate, w_up, grad)
    compiled = _run(torch.compile(swiglu, fullgraph=True), x, w_gate, w_up, grad)
    for mine, ref in zip(compiled, eager, strict=True):
        assert rel_err(mine, ref) < 1e-6


@pytest.mark.parametrize("case", ["eager", "fp8", "compiled"])
def test_the_mlp_calls_it_eager_unless_its_layers_are_fp8(monkeypatch, case: str) -> None:
    calls: list[int] = []
    monkeypatch.setattr("cp_train.model.mlp.swiglu", lambda *args: calls.append(1) or swiglu(*args))
    mlp = MLP(tiny_config(hidden_size=32, ffn_hidden_size=64), 0)
    if case == "fp8":  # any linear_fn but F.linear: FP8's scaled matmul (parallel/tp/fp8.py)
        mlp.gate.linear_fn = mlp.up.linear_fn = lambda x, w, b=None: F.linear(x, w, b)
    x = torch.randn(1, 8, 32)
    expected = F.linear(F.silu(F.linear(x, mlp.gate.weight)) * F.linear(x, mlp.up.weight), mlp.down.weight)
    out = (torch.compile(mlp) if case == "compiled" else mlp)(x)
    out.sum().backward()
    assert len(calls) == (1 if case == "eager" else 0)
    assert rel_err(out, expected) < 1e-6
