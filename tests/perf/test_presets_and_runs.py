"""The planner's model presets match the published parameter counts and load from HF configs and project YAML;
every published run names a known preset and profile, recorded as published."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cp_train.model.family import model_flops_per_token
from cp_train.model.hf.config import hf_config
from cp_train.perf.inputs.hardware import known_hardware
from cp_train.perf.inputs.presets import (
    ModelSpecError,
    load_model,
    model_preset,
    parameter_count,
    preset_names,
)
from cp_train.perf.inputs.runs import FLOP_CONVENTIONS, measured_run, measured_runs
from tests.perf.input_cases import PUBLISHED_PARAMETERS, ROOT, one_line_error

EXACT = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800,
         "llama2-7b": 6_738_415_616, "qwen2.5-7b": 7_615_616_512 - 28 * (3584 + 2 * 512)}


@pytest.mark.parametrize("name, tolerance", [("llama3-8b", 1e-3), ("llama3-70b", 1e-3), ("llama3-405b", 1e-3),
                                             ("llama2-7b", 1e-3), ("qwen2.5-7b", 5e-3)])
def test_preset_parameter_counts_match_the_published_sizes(name: str, tolerance: float) -> None:
    count = parameter_count(model_preset(name))
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=tolerance)
    assert count == EXACT[name]


def test_every_preset_is_a_valid_model_and_a_fresh_copy() -> None:
    for name in preset_names():
        model_preset(name).validate()
    first = model_preset("llama3-8b")
    first.rope_scaling["factor"] = 1.0
    assert model_preset("llama3-8b").rope_scaling["factor"] == 8.0
    assert model_preset("gpt-8b") == load_model(ROOT / "launch/configs/gpt-8b-128k-cp8.yaml")
    assert model_preset("gpt-1b").vocab_size == 32768


def test_an_unknown_model_lists_the_presets() -> None:
    for call in (lambda: model_preset("llama-8b"), lambda: load_model("llama-8b")):
        with pytest.raises(ModelSpecError) as error:
            call()
        one_line_error(error, "llama-8b", *preset_names())


def test_load_model_reads_hf_config_and_project_yaml(tmp_path: Path) -> None:
    llama = model_preset("llama3-8b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config(llama)))
    loaded = load_model(path)
    assert parameter_count(loaded) == parameter_count(llama) and loaded.num_kv_heads == 8
    assert loaded.rope_theta == 500000.0 and loaded.rope_scaling["rope_type"] == "llama3"
    assert load_model(tmp_path).hidden_size == 4096  # the directory holding config.json
    tiny = ROOT / "launch/configs/cpu-tiny.yaml"
    with pytest.raises(ModelSpecError) as error:
        load_model(tiny)
    one_line_error(error, "model.vocab_size")
    assert load_model(tiny, vocab_size=512).vocab_size == 512
    with pytest.raises(ModelSpecError) as error:
        load_model(tmp_path / "missing.json")
    one_line_error(error, "does not exist")


def test_every_published_run_names_a_known_preset_and_profile() -> None:
    presets, profiles = set(preset_names()), set(known_hardware())
    assert len({run.key for run in measured_runs()}) == len(measured_runs()) >= 30
    for run in measured_runs():
        assert run.model in presets and run.hardware in profiles, run.key
        assert run.precision in ("bf16", "fp8") and run.activation_checkpointing in (
            "full", "selective", "none", "unknown"), run.key
        value, unit = run.measured
        assert value > 0 and unit in ("tokens_per_s_per_gpu", "tflops_per_gpu", "attention_fraction_of_ideal")
        assert (run.tflops_per_gpu is None) == (run.flop_convention is None), run.key
        assert run.flop_convention in (None, *FLOP_CONVENTIONS), run.key
        assert run.layout_gpus == run.gpus or "a quarter" in run.notes, run.key
        run.model_config().validate(tp=run.tp, cp=run.cp, seq_len=run.seq_len, layout=run.cp_layout or "zigzag")


def test_the_issue_rows_are_recorded_as_published() -> None:
    titan = measured_run("titan-8b-128k-fsdp2-cp4")
    assert (titan.tokens_per_s_per_gpu, titan.peak_memory_gib, titan.seq_len, titan.gpus) == (1071, 84.0, 131072, 8)
    assert (titan.dp, titan.cp, titan.tp, titan.fsdp, titan.precision, titan.activation_checkpointing,
            titan.compiled, titan.hardware) == (2, 4, 1, True, "fp8", "full", True, "h100-sxm-96g")
    short = measured_run("titan-8b-8k-fsdp8-compile")
    assert (short.tokens_per_s_per_gpu, short.dp, short.precision, short.compiled) == (6667, 8, "bf16", True)
    nemo = measured_run("nemo-l2-7b-128k")
    assert (nemo.tflops_per_gpu, nemo.flop_convention, nemo.tp, nemo.cp, nemo.dp, nemo.gpus, nemo.precision) == (
        555, "causal_full", 4, 4, 8, 128, "fp8")
    ring = measured_run("ring-h800-zigzag")
    assert (ring.attention_fraction_of_ideal, ring.cp, ring.cp_layout, ring.hardware) == (0.902, 8, "zigzag", "h800")
    with pytest.raises(KeyError):
        measured_run("nope")


def test_rows_with_both_figures_count_causal_attention_in_full() -> None:
    """NeMo 24.07's TFLOP/s over tokens/s is 6N + 12·L·d·s per token (the 'full' convention), within 1%."""
    for run in measured_runs():
        if run.tflops_per_gpu is not None and run.tokens_per_s_per_gpu is not None:
            per_token = run.tflops_per_gpu * 1e12 / run.tokens_per_s_per_gpu
            full = model_flops_per_token(run.model_config(), run.seq_len, causal=False)
            assert math.isclose(per_token, full, rel_tol=0.01), run.key
