"""The planner's data: every hardware profile loads with sane constants and round-trips through YAML, a bad file
or name fails in one line naming the key, the presets match the published parameter counts, and every
published run names a known preset and profile in a layout the model accepts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cp_train.errors import InputError
from cp_train.model.family import model_flops_per_token
from cp_train.model.hf.config import hf_config
from cp_train.perf.inputs.hardware import HardwareError, from_dict, interpolate, known_hardware, load_hardware
from cp_train.perf.inputs.presets import (
    ModelSpecError,
    load_model,
    model_preset,
    parameter_count,
    preset_names,
)
from cp_train.perf.inputs.runs import FLOP_CONVENTIONS, measured_run, measured_runs

ROOT = Path(__file__).resolve().parents[2]
# published parameter counts (the model cards' / HF pages' rounding), the presets' checks
PUBLISHED_PARAMETERS: dict[str, float] = {
    "llama3-8b": 8.03e9,     # https://huggingface.co/meta-llama/Llama-3.1-8B ("8.03B params")
    "llama3-70b": 70.6e9,    # https://huggingface.co/meta-llama/Llama-3.1-70B ("70.6B params")
    "llama3-405b": 405.9e9,  # https://huggingface.co/meta-llama/Llama-3.1-405B (405,853,388,800 weights)
    "llama2-7b": 6.74e9,     # https://huggingface.co/meta-llama/Llama-2-7b-hf ("6.74B params")
    "qwen2.5-7b": 7.62e9,    # https://huggingface.co/Qwen/Qwen2.5-7B ("7.62B params", with the q/k/v biases)
}
BUILT_IN = ("h100-sxm", "h100-sxm-96g", "h200", "b200", "a100-80g", "h800")
POSITIVE = ("bf16_tflops", "hbm_gib", "hbm_tb_s", "nvlink_gb_s", "nvlink_latency_us", "net_gb_s", "net_latency_us",
            "collective_latency_us")


def _one_line_error(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert isinstance(error.value, InputError) and "\n" not in message and message
    for word in words:
        assert word in message, (word, message)
    return message


def test_the_named_profiles_are_built_in() -> None:
    assert set(BUILT_IN) <= set(known_hardware())


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_profile_loads_with_positive_constants(name: str) -> None:
    hardware = load_hardware(name)
    assert hardware.name == name and hardware.gpus_per_node == 8
    assert all(getattr(hardware, key) > 0 for key in POSITIVE)
    assert 0 < hardware.nvlink_efficiency <= 1 and 0 < hardware.net_efficiency <= 1
    assert hardware.nvlink_gb_s > hardware.net_gb_s
    for curve in (hardware.gemm_bf16, hardware.gemm_fp8):
        assert all(b[1] >= a[1] for a, b in zip(curve, curve[1:], strict=False))  # larger GEMMs: no slower
    assert (hardware.fp8_tflops > 0) == bool(hardware.gemm_fp8)
    assert 0.5 < hardware.gemm_fraction(2 * 8192 * 4096 * 4096) <= 1
    assert 0 < hardware.attention_fraction(128, 8192) < 1
    assert hardware.peak_tflops("bf16") == hardware.bf16_tflops


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_profile_round_trips_through_yaml(name: str, tmp_path: Path) -> None:
    hardware = load_hardware(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(hardware.to_yaml())
    assert load_hardware(str(path)) == hardware
    assert from_dict(hardware.to_dict()) == hardware


def test_a_file_missing_a_constant_names_it(tmp_path: Path) -> None:
    data = load_hardware("h100-sxm").to_dict()
    del data["nvlink_gb_s"]
    path = tmp_path / "mine.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    with pytest.raises(HardwareError) as error:
        load_hardware(path)
    _one_line_error(error, str(path), "missing nvlink_gb_s", "GB/s", "add it")


def test_an_unknown_name_lists_the_profiles() -> None:
    with pytest.raises(HardwareError) as error:
        load_hardware("h100")
    _one_line_error(error, "unknown hardware 'h100'", *BUILT_IN)
    with pytest.raises(HardwareError) as error:
        load_hardware("nowhere/h100.yaml")
    _one_line_error(error, "does not exist", "h100-sxm")


@pytest.mark.parametrize("change, words", [
    ({"nvlink_efficiency": 1.5}, ("nvlink_efficiency", "fraction")),
    ({"bf16_tflops": "fast"}, ("bf16_tflops", "number > 0")),
    ({"speed": 1}, ("unknown key 'speed'",)),
    ({"gemm_bf16": [[2e9, 0.5], [1e9, 0.6]]}, ("gemm_bf16", "increasing")),
    ({"gemm_bf16": []}, ("gemm_bf16", "pairs")),
    ({"attention_kernel": "fa3"}, ("attention_kernel 'fa3'", "cudnn")),
    ({"attention": [{"kernel": "cudnn", "head_dim": 128, "points": [[8192, 0.5]]}]}, ("attention[0]", "causal")),
    ({"gpus_per_node": 0}, ("gpus_per_node", "integer >= 1")),
])
def test_a_bad_value_names_the_key(change: dict, words: tuple[str, ...]) -> None:
    with pytest.raises(HardwareError) as error:
        from_dict({**load_hardware("h100-sxm").to_dict(), **change}, "hardware file x.yaml")
    _one_line_error(error, "hardware file x.yaml", *words)


def test_curves_interpolate_in_log_space_and_hold_their_ends() -> None:
    points = ((1.0, 0.1), (100.0, 0.3))
    assert interpolate(points, 10.0) == pytest.approx(0.2)
    assert interpolate(points, 0.5) == 0.1 and interpolate(points, 1e6) == 0.3


def test_attention_lookup_uses_the_nearest_head_dim_and_mask() -> None:
    h100, h200 = load_hardware("h100-sxm"), load_hardware("h200")
    assert h100.attention_fraction(64, 8192) == h100.attention_fraction(128, 8192) == pytest.approx(0.4533)
    assert h100.attention_fraction(128, 8192, causal=False) == pytest.approx(0.4533)  # no full curve: causal's
    assert h200.attention_fraction(128, 8192, causal=False) == pytest.approx(0.529)
    assert h200.attention_fraction(64, 8192) == pytest.approx(0.3872)  # its own head_dim's curve
    assert h200.attention_fraction(96, 8192) == pytest.approx(0.4723)  # the nearest in log2: 128
    assert h100.attention_fraction(128, 8192, kernel="flash2") == pytest.approx(0.2623)
    with pytest.raises(HardwareError) as error:
        h100.attention_fraction(128, 8192, kernel="fa3")
    _one_line_error(error, "fa3", "cudnn, flash2")


def test_precisions_and_a_gpu_without_fp8() -> None:
    h100, a100 = load_hardware("h100-sxm"), load_hardware("a100-80g")
    assert h100.peak_tflops("fp8") == 1979.0 and h100.gemm_fraction(1e12, "fp8") <= 0.71
    with pytest.raises(HardwareError) as error:
        a100.peak_tflops("fp8")
    _one_line_error(error, "a100-80g", "bf16")
    from cp_train.perf.rates import DeviceRates  # the rates check the precision once, at the boundary

    with pytest.raises(HardwareError):
        DeviceRates(h100, "fp16")
    with pytest.raises(HardwareError) as error:
        DeviceRates(a100, "fp8")
    _one_line_error(error, "a100-80g", "no fp8 peak")


# exact counts of the released checkpoints (HF safetensors totals); Qwen2.5-7B's less its 129,024 q/k/v biases
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
        _one_line_error(error, "llama-8b", *preset_names())


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
    _one_line_error(error, "model.vocab_size")
    assert load_model(tiny, vocab_size=512).vocab_size == 512
    with pytest.raises(ModelSpecError) as error:
        load_model(tmp_path / "missing.json")
    _one_line_error(error, "does not exist")


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


def test_fp8_linears_pay_their_casts_and_keep_the_head_in_bf16() -> None:
    """``--precision fp8``: the block GEMMs run at the fp8 rate and add the recipe's ``FP8_CAST_BYTES`` per element
    cast at the memory rate: tensorwise the input and weight forward and the output's gradient backward; rowwise
    also the input and weight again backward and the gradient twice (more bytes in all); the LM head stays bf16.
    Under FSDP tensorwise gathers the linear weights in fp8, each gather casting this rank's shard; rowwise gathers
    them in bf16."""
    from bench.planner_published import run_config
    from cp_train.perf.rates import DeviceRates
    from cp_train.perf.time_model import FP8_CAST_BYTES, fp8_cast_seconds, fp8_gathered_weights, matmul_seconds
    from cp_train.perf.workload import build_workload

    run = next(r for r in measured_runs() if r.key == "titan-8b-8k-fsdp8-fp8")
    hardware = load_hardware("h100-sxm")
    bf16, fp8 = DeviceRates(hardware, "bf16"), DeviceRates(hardware, "fp8")
    casts = {}
    for recipe in ("tensorwise", "rowwise"):
        for fsdp in (False, True):
            config = run_config(run, "none")
            config.model.fp8, config.parallel.fsdp = recipe, fsdp
            work = build_workload(config, 8, 2)
            assert fp8_cast_seconds(work, bf16) == (0.0, 0.0)
            forward, backward = fp8_cast_seconds(work, fp8)
            inputs = sum(g.count * g.m * g.k for g in work.gemms)
            weights = sum(g.count * g.k * g.n for g in work.gemms)
            gradients = sum(g.count * g.m * g.n for g in work.gemms)
            per_operand, again, per_gradient = FP8_CAST_BYTES[recipe]
            in_fp8 = fsdp and recipe == "tensorwise"  # ZeRO-3 over 8 ranks: two gathers, each casts a shard
            assert fp8_gathered_weights(work, fp8) == (weights / config.model.num_layers if in_fp8 else 0.0)
            cast_weights = weights * 2 / 8 if in_fp8 else weights
            assert forward == pytest.approx(per_operand * (inputs + cast_weights) / fp8.memory_bytes_per_s)
            assert backward == pytest.approx((again * (inputs + weights) + per_gradient * gradients)
                                             / fp8.memory_bytes_per_s)
            if not fsdp:
                casts[recipe] = forward + backward
    assert casts["rowwise"] > 1.5 * casts["tensorwise"], casts
    blocks_bf16, head_bf16, _ = matmul_seconds(work, bf16)
    blocks_fp8, head_fp8, _ = matmul_seconds(work, fp8)
    assert head_fp8 == head_bf16 and blocks_fp8 < 0.75 * blocks_bf16


def test_fsdp_exposes_the_root_units_gather_and_reduce_scatter() -> None:
    """On GPUs FSDP's blocks hide behind compute, the root unit (embedding, norm, head) cannot: across nodes its
    gather and reduce-scatter, and every unit's copy-out into its parameters on the compute stream (the unsharded
    bf16 bytes read and written; the blocks twice, resharded after the forward), are the exposed data-parallel
    time of a long enough step."""
    from bench.planner_published import run_config
    from cp_train.perf.inputs.presets import layer_parameters, root_parameters
    from cp_train.perf.predict import FSDP_COPY_OUT_PASSES, breakdown
    from cp_train.perf.rates import DeviceRates
    from cp_train.perf.time_model import collective_seconds
    from cp_train.perf.workload import build_workload

    run = next(r for r in measured_runs() if r.key == "titan-8b-8k-fsdp128-compile")
    config = run_config(run, "selective")
    config.parallel.dp = run.dp
    rates = DeviceRates(load_hardware(run.hardware))
    work = build_workload(config, run.gpus, 2)
    root, link = root_parameters(config.model), rates.link(True)
    expected = (work.accumulation * collective_seconds("all_gather", 2 * root // run.dp, run.dp, link)
                + collective_seconds("reduce_scatter", 4 * root, run.dp, link))
    unsharded = 2 * config.model.num_layers * layer_parameters(config.model) + root
    copy_out = work.accumulation * FSDP_COPY_OUT_PASSES * 2 * unsharded / rates.memory_bytes_per_s
    assert breakdown(work, rates).data_comm == pytest.approx(expected + copy_out, rel=1e-6)
    assert 0.01 < copy_out / breakdown(work, rates).step < 0.03  # 2% of the 8B model's step at 8k


def test_the_gpu_table_and_the_profiles_agree_on_the_peaks() -> None:
    """One table of GPU names (``metrics.throughput.GPUS``): the MFU's peak and the planner's profile for the run
    check; a profile it names has that peak, and an NVL part (another peak) has no profile, so it is not predicted."""
    from cp_train.metrics.throughput import GPUS, gpu_entry
    from cp_train.perf.run_check import device_profile

    named = {profile for _, profile in GPUS.values() if profile}
    assert named <= set(known_hardware()) and {"h100-sxm", "h200", "b200"} <= named
    for peak, profile in GPUS.values():
        if profile:
            assert load_hardware(profile).bf16_tflops == peak, profile
    assert gpu_entry("NVIDIA H200 NVL") == (835.0, None) and device_profile("NVIDIA H200 NVL") is None
    assert device_profile("NVIDIA H200") == "h200" and device_profile("NVIDIA H100 80GB HBM3") == "h100-sxm"
