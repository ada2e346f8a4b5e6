"""``bench/fp8_linears.py`` on CPU at a toy shape: its FP8 GEMMs compute the bf16 GEMMs' products (operands,
layouts and scales right), and its totals and step cap add up, so the GPU run measures the GEMMs it names."""

from __future__ import annotations

import pytest
import torch

from bench import fp8_linears
from cp_train.parallel.tp.fp8 import fp8_unavailable

if fp8_unavailable("tensorwise", torch.device("cpu")):  # the dev extra installs torchao
    pytest.skip(fp8_unavailable("tensorwise", torch.device("cpu")), allow_module_level=True)

CPU = torch.device("cpu")


def _products(recipe: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # every recipe's operands from the same draws
    calls = fp8_linears.gemm_calls(recipe, 64, 96, 48, CPU, (True, False, False))
    return {name: call().float() for name, call in calls}


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gemms_compute_the_bf16_products(recipe: str) -> None:
    bf16, fp8 = _products("bf16"), _products(recipe)
    assert [name for name in fp8] == ["output", "grad input", "grad weight"]
    for name, product in fp8.items():
        assert product.shape == bf16[name].shape
        # FP8's rounding (e4m3: 3 mantissa bits; tensorwise's e5m2 gradients: 2) moves a product by 4-6% here: a wrong
        # layout or scale by far more (below), the bf16 products not at all
        assert 0.01 < _error(product, bf16[name]) < 0.1, (name, _error(product, bf16[name]))
    # the check tells products apart: another draw's product is nowhere near
    torch.manual_seed(1)
    other = dict((name, call().float()) for name, call in fp8_linears.gemm_calls("bf16", 64, 96, 48, CPU, (0, 0, 0)))
    assert all(_error(other[name], bf16[name]) > 0.5 for name in bf16)


def test_totals_and_the_step_cap(capsys) -> None:
    records = fp8_linears.main(["--tiny", "--bf16-step", "0.5", "--samples", "2", "--recipes", "bf16", "tensorwise"])
    per_linear = [r for r in records if not r["linear"].startswith("model")]
    assert len(per_linear) == 2 * 4 * 2  # recipes x the block's 4 linears x (gemm, linear)
    assert {r["linear"] for r in per_linear} == {"qkv", "attention out", "mlp gate+up", "mlp down"}
    totals = {(r["recipe"], r["part"]): r for r in records if r["linear"].startswith("model")}
    for (recipe, part), total in totals.items():
        block = sum(r["ms"] for r in per_linear if r["recipe"] == recipe and r["part"] == part)
        assert total["ms"] == pytest.approx(2 * block)  # the tiny model's 2 blocks
        bf16 = totals["bf16", part]["ms"]
        assert total["best_step_s"] == pytest.approx(0.5 - (bf16 - total["ms"]) * 2 / 1e3)
        assert total["step_speedup_cap"] == pytest.approx(0.5 / total["best_step_s"])
    assert totals["bf16", "gemm"]["speedup"] == 1.0 and totals["bf16", "gemm"]["step_speedup_cap"] == 1.0
    gemm = next(r for r in per_linear if r["recipe"] == "tensorwise" and r["part"] == "gemm")
    assert set(gemm["gemms"]) == {"output", "grad input", "grad weight"}
    assert gemm["gemms"]["output"]["flops"] == 2 * 64 * gemm["in"] * gemm["out"]
    # the planner's time for the same GEMMs (h200's curves): FP8's below bf16's, the model's the blocks' sum
    assert totals["tensorwise", "gemm"]["planned_ms"] < totals["bf16", "gemm"]["planned_ms"]
    assert totals["bf16", "gemm"]["planned_ms"] == pytest.approx(
        2 * sum(r["planned_ms"] for r in per_linear if r["recipe"] == "bf16" and r["part"] == "gemm"))
    assert "step cap" in capsys.readouterr().out


def test_tp_local_shapes_and_the_one_line_shape_error() -> None:
    """``--set parallel.tp=2`` times each rank's shard (column-parallel outputs, row-parallel inputs halved); a
    token count the GPU's FP8 GEMMs refuse stops the bench with the config's one line, before any timing."""
    full, half = (fp8_linears.main(["--tiny", "--parts", "gemm", "--recipes", "bf16", *extra])
                  for extra in ([], ["--set", "parallel.tp=2"]))
    shapes = [{r["linear"]: (r["in"], r["out"]) for r in records if "in" in r} for records in (full, half)]
    assert shapes[1]["qkv"] == (shapes[0]["qkv"][0], shapes[0]["qkv"][1] // 2)
    assert shapes[1]["mlp down"] == (shapes[0]["mlp down"][0] // 2, shapes[0]["mlp down"][1])
    with pytest.raises(SystemExit) as stop:
        fp8_linears.main(["--tiny", "--tokens", "60", "--recipes", "bf16", "tensorwise"])
    message = str(stop.value)
    assert "\n" not in message and "multiple of 16" in message and "--tokens is data.seq_len" in message


def test_a_fast_recipe_row_accumulates_every_gemm_fast() -> None:
    """``tensorwise-fast``: the recipe's GEMMs with fast accumulation in all three (``model.fp8_fast_accum=all``),
    where tensorwise keeps the recipe's (the output GEMM only); both rows time the same shapes; its linear row runs
    the trainer's ``Float8Matmul`` with those settings."""
    records = fp8_linears.main(["--tiny", "--recipes", "bf16", "tensorwise", "tensorwise-fast"])
    gemm = {r["recipe"]: r for r in records if r["part"] == "gemm" and r["linear"] == "qkv"}
    assert gemm["tensorwise"]["fast_accum"] == [True, False, False]
    assert gemm["tensorwise-fast"]["fast_accum"] == [True, True, True] and gemm["bf16"]["fast_accum"] == [False] * 3
    assert (gemm["tensorwise-fast"]["in"], gemm["tensorwise-fast"]["out"]) == (gemm["bf16"]["in"], gemm["bf16"]["out"])
    assert fp8_linears.recipe_config("tensorwise-fast", CPU).gemm_config_grad_weight.use_fast_accum
    assert any(r["recipe"] == "tensorwise-fast" and r["part"] == "linear" and r["ms"] > 0 for r in records)


def test_tensorwise_casts_are_counted_and_added_back() -> None:
    """A tensorwise gemm row's ``cast_ms``: its casts' bytes as the trainer's FP8 matmul moves them (input 7,
    gradient 7 and fp32 weight 11 bytes per element over forward and backward) at the planner's memory rate; the
    model's the blocks' sum; the step with them is the cap's step plus their time, so below the cap. Rowwise is not
    counted."""
    records = fp8_linears.main(["--tiny", "--parts", "gemm", "--bf16-step", "0.5", "--recipes", "bf16", "tensorwise",
                                "rowwise"])
    rate = fp8_linears.DeviceRates(fp8_linears.load_hardware("h200"), "fp8").memory_bytes_per_s
    qkv = next(r for r in records if r["recipe"] == "tensorwise" and r["linear"] == "qkv")
    tokens, n_in, n_out = qkv["tokens"], qkv["in"], qkv["out"]
    counted = fp8_linears.tensorwise_cast_bytes(tokens, n_in, n_out)
    assert counted == tokens * (7 * n_in + 7 * n_out) + 11 * n_in * n_out
    assert qkv["cast_ms"] == pytest.approx(1e3 * fp8_linears.tensorwise_cast_bytes(tokens, n_in, n_out) / rate)
    totals = {r["recipe"]: r for r in records if r["linear"].startswith("model")}
    rows = [r for r in records if r["recipe"] == "tensorwise" and not r["linear"].startswith("model")]
    assert totals["tensorwise"]["cast_ms"] == pytest.approx(2 * sum(r["cast_ms"] for r in rows))
    assert totals["tensorwise"]["step_with_casts_s"] == pytest.approx(
        totals["tensorwise"]["best_step_s"] + totals["tensorwise"]["cast_ms"] / 1e3)
    assert totals["tensorwise"]["speedup_with_casts"] < totals["tensorwise"]["step_speedup_cap"]
    assert totals["rowwise"]["cast_ms"] is None and "speedup_with_casts" not in totals["rowwise"]
    assert totals["bf16"]["cast_ms"] is None
