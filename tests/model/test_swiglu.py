"""``model/mlp.py``'s fused gate/up weight and ``swiglu``, the SwiGLU as one autograd node.

The node against a float64 reference by relative error and against autograd on the plain expression of the same
fused weight (output and gradients bitwise, in fp32 and under bf16 autocast); against the two matmuls of separate
gate and up weights within 1e-6; what autograd keeps (the weight itself, no silu, ``x`` once); one backward per
forward; compiled equals eager; the MLP calls it eager only and not for FP8 layers; the blocks (gate's and up's
alternating), the initial values of two weights drawn from their own seeds, and the error for a tp that would split
a block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_train.model.config import gate_up_block, param_seed
from cp_train.model.mlp import (
    MLP,
    gate_up_pairs,
    gated_silu,
    pair_gate_up,
    split_gate_up,
    swiglu,
)
from tests.model_cases import tiny_config
from tests.numerics import rel_err

TOKENS, HIDDEN, FFN = 37, 64, 96
BLOCK = gate_up_block(FFN)  # 12: 8 blocks


def plain(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_pairs(F.linear(x, w_gate_up), BLOCK, -1)
    return (F.silu(gate) * up).flatten(-2)


def node(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu(x, w_gate_up, BLOCK)


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w_gate_up = (torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
                    for shape in ((2, TOKENS, HIDDEN), (2 * FFN, HIDDEN)))
    return x, w_gate_up, torch.randn(2, TOKENS, FFN, generator=g, dtype=dtype)


def _run(fn, x, w_gate_up, grad) -> tuple[torch.Tensor, ...]:
    y = fn(x, w_gate_up)
    return (y, *torch.autograd.grad(y, (x, w_gate_up), grad.to(y.dtype)))


def _float64(x, w_gate_up, grad) -> tuple[torch.Tensor, ...]:
    return _run(plain, *(t.detach().double().requires_grad_() for t in (x, w_gate_up)), grad.double())


def test_fp32_is_autograds_bitwise_and_matches_float64() -> None:
    x, w_gate_up, grad = _inputs()
    mine, autograd = _run(node, x, w_gate_up, grad), _run(plain, x, w_gate_up, grad)
    for name, ours, theirs, ref in zip(("y", "dx", "dw"), mine, autograd, _float64(x, w_gate_up, grad), strict=True):
        assert torch.equal(ours, theirs), name
        assert rel_err(ours, ref) < 1e-6, (name, rel_err(ours, ref))


def test_equals_two_matmuls_of_separate_weights() -> None:
    x, w_gate_up, grad = _inputs(seed=2)
    w_gate, w_up = (w.detach().requires_grad_() for w in split_gate_up(w_gate_up, BLOCK))
    y = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
    dx, dw_gate, dw_up = torch.autograd.grad(y, (x, w_gate, w_up), grad)
    mine = _run(node, x, w_gate_up, grad)
    for name, ours, ref in zip(("y", "dx", "dw"), mine, (y, dx, pair_gate_up(dw_gate, dw_up, BLOCK)), strict=True):
        assert rel_err(ours, ref) < 1e-6, (name, rel_err(ours, ref))


def test_bf16_autocast_computes_in_bf16_as_autograd_does() -> None:
    x, w_gate_up, grad = _inputs()
    with torch.autocast("cpu", torch.bfloat16):
        mine, autograd = _run(node, x, w_gate_up, grad), _run(plain, x, w_gate_up, grad)
    assert mine[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in mine[1:])
    for ours, theirs, ref in zip(mine, autograd, _float64(x, w_gate_up, grad), strict=True):
        assert torch.equal(ours, theirs)
        assert rel_err(ours, ref) < 2e-2


def test_keeps_the_weight_itself_and_no_silu_and_runs_one_backward() -> None:
    x, w_gate_up, grad = _inputs()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        node(x, w_gate_up)
    assert [tuple(t.shape) for t in saved] == [(2, TOKENS, HIDDEN), (2 * FFN, HIDDEN), (2, TOKENS, 2 * FFN)]
    assert saved[0] is x and saved[1] is w_gate_up  # no copies: FSDP2 frees the weight as a linear's
    unfused: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: unfused.append(t.numel()) or t, lambda t: t):
        plain(x, w_gate_up)
    # autograd keeps x, the weight, gate and up (views of the matmul's output) and silu(gate) besides
    assert sum(unfused) - sum(t.numel() for t in saved) == 2 * TOKENS * FFN
    y = node(x, w_gate_up)  # without hooks: autograd checks the saved tensors' versions
    y.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # its output became its gradient
        y.backward(grad)


def test_compiled_equals_eager() -> None:
    x, w_gate_up, grad = _inputs(seed=1)
    eager = _run(node, x, w_gate_up, grad)
    compiled = _run(torch.compile(node, fullgraph=True), x, w_gate_up, grad)
    for mine, ref in zip(compiled, eager, strict=True):
        assert rel_err(mine, ref) < 1e-6


def test_gated_silu_keeps_only_the_matmul_output_and_matches_float64() -> None:
    """What the MLP runs compiled and under FP8 after the layer's matmul: the views' expression within 1e-6 in fp32,
    compiled too, keeping the output alone."""
    out = torch.randn(2, TOKENS, 2 * FFN, generator=torch.Generator().manual_seed(3), requires_grad=True)
    grad = torch.randn(2, TOKENS, FFN, generator=torch.Generator().manual_seed(4))

    def views(t: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_pairs(t, BLOCK, -1)
        return (F.silu(gate) * up).flatten(-2)

    def run(fn, t: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = fn(t)
        return y, torch.autograd.grad(y, t, g)[0]

    reference = run(views, out.detach().double().requires_grad_(), grad.double())
    for fn in (lambda t: gated_silu(t, BLOCK), torch.compile(lambda t: gated_silu(t, BLOCK), fullgraph=True), views):
        for mine, ref in zip(run(fn, out, grad), reference, strict=True):
            assert rel_err(mine, ref) < 1e-6
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gated_silu(out, BLOCK)
    assert len(saved) == 1 and saved[0] is out


@pytest.mark.parametrize(("ffn", "block"), [(8192, 64), (14336, 64), (10944, 57), (2816, 44), (1344, 56), (64, 8),
                                           (96, 12), (100, 1)])
def test_gate_up_blocks_leave_a_multiple_of_8_blocks(ffn: int, block: int) -> None:
    assert gate_up_block(ffn) == block and (ffn % 8 or (ffn // block) % 8 == 0)


def test_gate_up_alternates_blocks_and_keeps_the_two_seeded_weights() -> None:
    config = tiny_config(hidden_size=32, ffn_hidden_size=64)
    weight = MLP(config, 3).gate_up.weight.detach()
    gate, up = split_gate_up(weight, 8)
    for half, name in ((gate, "gate"), (up, "up")):
        g = torch.Generator().manual_seed(param_seed(config.seed, f"layers.3.mlp.{name}"))
        assert torch.equal(half, torch.empty(64, 32).normal_(0.0, config.init_std, generator=g)), name
    assert torch.equal(weight[:8], gate[:8]) and torch.equal(weight[8:16], up[:8]) and torch.equal(weight[16:24],
                                                                                                   gate[8:16])
    assert torch.equal(pair_gate_up(gate, up, 8), weight)


def test_tp_ranks_hold_whole_blocks_or_the_error_says_what_to_change() -> None:
    config = tiny_config(hidden_size=64, num_heads=16, num_kv_heads=16, vocab_size=256, ffn_hidden_size=96)
    config.validate(8)  # 8 blocks of 12 rows: whole blocks up to tp 8
    with pytest.raises(ValueError, match=r"^ffn_hidden_size 96 alternates gate and up in 8 blocks of 12 rows, not "
                                         r"divisible by tp = 16; make ffn_hidden_size a multiple of 8192 or change "
                                         r"tp$"):
        config.validate(16)  # 96 divides by 16, its 8 blocks do not


@pytest.mark.parametrize("case", ["eager", "fp8", "compiled", "compiled-checkpointed"])
def test_the_mlp_calls_it_eager_unless_its_layers_are_fp8(monkeypatch, case: str) -> None:
    """Eager the node; compiled and under FP8 the layer's matmul, then ``gated_silu``; compiled inside the block's
    checkpoint, the plain expression (torch 2.11's compile would keep gated_silu's output there)."""
    calls: list[str] = []
    monkeypatch.setattr("cp_train.model.mlp.swiglu", lambda *args: calls.append("node") or swiglu(*args))
    monkeypatch.setattr("cp_train.model.mlp.gated_silu", lambda *args: calls.append("gated") or gated_silu(*args))
    checkpointing = "full" if case == "compiled-checkpointed" else "none"
    mlp = MLP(tiny_config(hidden_size=32, ffn_hidden_size=64, activation_checkpointing=checkpointing), 0)
    if case == "fp8":  # any linear_fn but F.linear: FP8's scaled matmul (parallel/tp/fp8.py)
        mlp.gate_up.linear_fn = lambda x, w, b=None: F.linear(x, w, b)
    x = torch.randn(1, 8, 32)
    w_gate, w_up = split_gate_up(mlp.gate_up.weight, mlp.block)
    expected = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), mlp.down.weight)
    out = (torch.compile(mlp) if case.startswith("compiled") else mlp)(x)
    out.sum().backward()
    assert calls == {"eager": ["node"], "compiled-checkpointed": []}.get(case, ["gated"])
    assert rel_err(out, expected) < 1e-6
