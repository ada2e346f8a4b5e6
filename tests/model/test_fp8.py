"""``model.fp8`` on one process (``parallel/tp/fp8.py``; torchao's emulation on CPU): what converts, the matmul against
torchao's own ``Float8Linear`` and a float64 reference, the model's loss and gradients against fp32, activation
checkpointing, compile, fast accumulation and the MFU at the FP8 peak. The one-line errors, the conversion, FSDP's FP8
gathers, the planner's switch and the resume note are in ``test_fp8_setup.py``.

The rank-side runs (cp 2 curves, FSDP with tp 2 x cp 2, checkpoints) are in ``tests/train/test_fp8_train.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cp_train.metrics.throughput import FP8_PEAK_RATIO, IntervalMeter, fp8_flops_per_token
from cp_train.model import GPTModel
from cp_train.model.family import get_model_family
from cp_train.parallel.tp.fp8 import (
    Float8Matmul,
    convert_to_fp8,
    float8_config,
    fp8_layers,
    fp8_unavailable,
    import_float8,
)
from tests.model_cases import global_batch, step, tiny_config
from tests.numerics import rel_err

CPU = torch.device("cpu")
if fp8_unavailable("tensorwise", CPU):  # the dev extra installs torchao
    pytest.skip(fp8_unavailable("tensorwise", CPU), allow_module_level=True)
RECIPES = ("tensorwise", "rowwise")
BLOCK_LINEARS = ("attention.qkv", "attention.proj", "mlp.gate_up", "mlp.down")


def fp8_model(recipe: str, **overrides) -> GPTModel:
    model = GPTModel(tiny_config(**overrides))
    assert convert_to_fp8(model.layers, recipe, CPU, prefix="layers.") == fp8_layers(model)  # as cp_train.build does
    return model


@pytest.mark.parametrize("recipe", RECIPES)
def test_only_the_block_linears_convert_and_the_state_dict_is_unchanged(recipe: str) -> None:
    plain, model = GPTModel(tiny_config()), fp8_model(recipe)
    layers = plain.config.num_layers
    assert fp8_layers(model) == [f"layers.{i}.{name}" for i in range(layers) for name in BLOCK_LINEARS]
    assert all(isinstance(model.get_submodule(name).linear_fn, Float8Matmul) for name in fp8_layers(model))
    assert model.lm_head.linear_fn is F.linear  # the head and the embedding stay in the compute dtype
    state, reference = model.state_dict(), plain.state_dict()
    assert state.keys() == reference.keys()
    assert all(type(t) is torch.Tensor and torch.equal(t, reference[k]) for k, t in state.items())
    assert convert_to_fp8(GPTModel(tiny_config()).layers, "none", CPU) == [] and fp8_layers(plain) == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_matmul_is_torchaos_float8_linear_bitwise_and_near_float64(recipe: str) -> None:
    """Forward and both gradients equal those of torchao's ``Float8Linear`` with the same config, bitwise; against a
    float64 ``F.linear`` the FP8 error is there (above 1e-3) and bounded (below 10%)."""
    gen = torch.Generator().manual_seed(0)
    x, weight, grad = torch.randn(4, 16, 64, generator=gen), torch.randn(96, 64, generator=gen), torch.randn(4, 16, 96)
    config = float8_config(recipe, emulate=True)
    linear = nn.Linear(64, 96, bias=False)
    linear.weight.data.copy_(weight)
    theirs = import_float8().convert_to_float8_training(nn.Sequential(linear), config=config)[0]
    assert type(theirs).__name__ == "Float8Linear"
    ours_x, ours_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = Float8Matmul(config)(ours_x, ours_w)
    ours.backward(grad)
    their_x = x.clone().requires_grad_()
    reference = theirs(their_x)
    reference.backward(grad)
    assert torch.equal(ours, reference) and torch.equal(ours_x.grad, their_x.grad)
    assert torch.equal(ours_w.grad, theirs.weight.grad)
    exact = F.linear(x.double(), weight.double())
    assert 1e-3 < rel_err(ours, exact) < 0.1


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_model_tracks_fp32_and_checkpointing_recomputes_exactly(recipe: str) -> None:
    """Losses within 1% and gradients within 25% of fp32 (FP8 gradients: e5m2 or e4m3); every activation
    checkpointing mode gives bitwise the same gradients (the dynamic scales are recomputed alike)."""
    data = global_batch(tiny_config())
    reference = step(GPTModel(tiny_config()), data)
    runs = {mode: step(fp8_model(recipe, activation_checkpointing=mode), data) for mode in ("none", "full",
                                                                                            "selective")}
    got = runs["none"]
    assert 0 < rel_err(got["losses"], reference["losses"]) < 1e-2
    assert max(rel_err(got["grads"][n], g) for n, g in reference["grads"].items()) < 0.25
    for mode in ("full", "selective"):
        assert all(torch.equal(runs[mode]["grads"][n], g) for n, g in got["grads"].items()), mode


def test_compiled_equals_eager() -> None:
    """Three AdamW steps of the tiny model with FP8 linears in its first block and the last kept in the compute dtype
    (``model.fp8_bf16_layers_at_end``), eager and with ``compile_parts``: fullgraph, no graph break, one graph per
    kind of block and the head's. The first step's loss agrees within 1e-6 and its gradients within 1e-5 (the kept
    block's fp32 sums compile in another order: 3e-8 and 4e-7 measured); the later losses within 1e-4 (FP8's
    rounding of the updated weights carries those differences on: 2e-5 measured at step 3)."""
    from torch._dynamo.utils import counters

    config = tiny_config(fp8="tensorwise", fp8_bf16_layers_at_end=1)
    batches = [global_batch(config, seed=seed) for seed in range(3)]
    losses, first_grads = {}, {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        model = GPTModel(config)
        assert len(convert_to_fp8(model.layers, "tensorwise", CPU, indices=config.fp8_blocks)) == 4
        if mode == "compiled":
            model.compile_parts()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[mode] = []
        for data in batches:
            loss = (model(data["tokens"], labels=data["labels"]) * data["weights"]).sum()
            loss.backward()
            first_grads.setdefault(mode, {n: p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            losses[mode].append(loss.item())
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == (3 if mode == "compiled" else 0), dict(counters["stats"])
    torch._dynamo.reset()
    assert rel_err(losses["compiled"][0], losses["eager"][0]) < 1e-6, losses
    assert max(rel_err(first_grads["compiled"][n], g) for n, g in first_grads["eager"].items()) < 1e-5
    assert max(rel_err(c, e) for c, e in zip(losses["compiled"], losses["eager"], strict=True)) < 1e-4, losses


def test_tensorwise_casts_each_operand_once() -> None:
    """Tensorwise serves both GEMMs an operand enters with one cast, so ``Float8Matmul`` casts the input and the
    weight once, before torchao's matmul (rowwise casts per GEMM: not). In the joint graph AOTAutograd partitions
    (the min-cut partitioner Inductor uses; torchao's real FP8 GEMMs, ``_scaled_mm`` on CPU): the forward takes
    two absolute maxima (the input's, the weight's) where torchao's matmul alone takes three (the input's again for
    the weight's gradient), the backward one (the output gradient's), and the backward keeps the input and the
    weight in FP8. Eager keeps the FP8 input for the backward, not the bf16 one. The results are torchao's bitwise
    (``test_the_matmul_is_torchaos_float8_linear_bitwise_and_near_float64``)."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition

    assert Float8Matmul(float8_config("tensorwise", emulate=True)).cast_once == (True, True)
    assert Float8Matmul(float8_config("rowwise", emulate=True)).cast_once == (False, False)
    x0, w0 = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32)
    seen: dict[str, tuple[int, list[torch.dtype]]] = {}

    def compiler(name: str):
        def record(graph, inputs):
            maxima = sum(node.target is torch.ops.aten.max.default for node in graph.graph.nodes)
            seen[name] = maxima, [t.dtype for t in inputs]
            return graph
        return record

    for label, once in (("ours", True), ("torchao alone", False)):
        matmul = Float8Matmul(float8_config("tensorwise", emulate=False))
        matmul.cast_once = (once, once)

        def f(x: torch.Tensor, w: torch.Tensor, matmul: Float8Matmul = matmul) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return matmul(x, w)

        compiled = aot_function(f, fw_compiler=compiler(f"{label} forward"),
                                bw_compiler=compiler(f"{label} backward"),
                                partition_fn=min_cut_rematerialization_partition)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        compiled(x, w).sum().backward()
    assert seen["ours forward"][0] == 2 and seen["torchao alone forward"][0] == 3
    assert seen["ours backward"][0] == 1
    assert seen["ours backward"][1].count(torch.float8_e4m3fn) == 2  # the input and the weight, kept in FP8
    kept = {}
    for weight_once in (True, False):  # False: FSDP's gathered weight, kept as it is for FSDP to free and gather
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            matmul = Float8Matmul(float8_config("tensorwise", emulate=True), cast_weight_once=weight_once)
            matmul(x0.clone().requires_grad_(), w0.requires_grad_())
        kept[weight_once] = [getattr(t, "_data", t).dtype for t in saved]
    assert kept == {True: [torch.float8_e4m3fn, torch.float8_e4m3fn], False: [torch.float8_e4m3fn, torch.float32]}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fast_accumulation_reaches_the_gemms_it_names(recipe: str) -> None:
    """``model.fp8_fast_accum``: output (the recipes' own: the forward GEMM only), all, none; the converted layers'
    matmul carries it to torchao's per-GEMM settings, FSDP's FP8 weight wrapper included; the recipe's casts stay."""
    for choice, flags in (("output", (True, False, False)), ("all", (True, True, True)), ("none", (False,) * 3)):
        config = float8_config(recipe, emulate=True, fast_accum=choice)
        own = import_float8().Float8LinearConfig.from_recipe_name(recipe)
        assert config.cast_config_input == own.cast_config_input and config.emulate
        assert (config.gemm_config_output.use_fast_accum, config.gemm_config_grad_input.use_fast_accum,
                config.gemm_config_grad_weight.use_fast_accum) == flags
        model = GPTModel(tiny_config())
        convert_to_fp8(model.layers, recipe, CPU, fsdp_shards=2, fast_accum=choice)
        matmul = model.layers[0].mlp.down.linear_fn
        assert tuple(c.use_fast_accum for c in matmul.mm_config) == flags
        weight = model.layers[0].mlp.down.weight  # the FSDP FP8 gather's wrapper (tensorwise) holds the same settings
        if recipe == "tensorwise":
            assert tuple(c.use_fast_accum for c in weight._linear_mm_config) == flags
    assert float8_config(recipe, emulate=True) == dataclasses.replace(
        import_float8().Float8LinearConfig.from_recipe_name(recipe), emulate=True)  # the default is the recipe's


# ----------------------------------------------------------------------------------------------- metrics
def test_mfu_counts_the_fp8_linears_at_the_fp8_peak() -> None:
    """``mfu`` stays at the bf16 peak; ``mfu_fp8_peak`` counts the blocks' linears (6 x their weights per token)
    at FP8_PEAK_RATIO x that peak and everything else at it; a bf16 run has no ``mfu_fp8_peak``."""
    config = dataclasses.replace(tiny_config(), fp8="tensorwise")
    family = get_model_family(config.family)
    block = config.num_layers * sum(x.in_features * x.out_features for x in family.block_linears(config))
    assert fp8_flops_per_token(config) == 6.0 * block > 0
    assert fp8_flops_per_token(dataclasses.replace(config, fp8="none")) == 0.0
    meter = IntervalMeter.for_model(config, 32, 4, 2, 100.0)
    meter.add(loss=1.0, step_time=0.1, data_time=0.0)
    record = meter.record(1, 1e-3, 1.0, 4, 32, 0.1)
    fp8_share = meter.fp8_flops_per_token / meter.flops_per_token
    expected = record["mfu"] * (fp8_share / FP8_PEAK_RATIO + 1 - fp8_share)
    assert record["mfu_fp8_peak"] == pytest.approx(expected, rel=1e-12) and record["mfu_fp8_peak"] < record["mfu"]
    bf16 = IntervalMeter.for_model(dataclasses.replace(config, fp8="none"), 32, 4, 2, 100.0)
    bf16.add(loss=1.0, step_time=0.1, data_time=0.0)
    assert "mfu_fp8_peak" not in bf16.record(1, 1e-3, 1.0, 4, 32, 0.1)
