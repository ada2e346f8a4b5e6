"""The planner's data: every hardware profile loads with sane constants and round-trips through YAML, a bad file
or name fails in one line naming the key; FP8 linears and FSDP in the workload (the presets and published runs:
``test_presets_and_runs.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cp_train.perf.inputs.hardware import HardwareError, from_dict, interpolate, known_hardware, load_hardware
from cp_train.perf.inputs.runs import measured_runs
from tests.perf.input_cases import one_line_error

BUILT_IN = ("h100-sxm", "h100-sxm-96g", "h200", "b200", "a100-80g", "h800")
POSITIVE = ("bf16_tflops", "hbm_gib", "hbm_tb_s", "nvlink_gb_s", "nvlink_latency_us", "net_gb_s", "net_latency_us",
            "collective_latency_us")


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
    one_line_error(error, str(path), "missing nvlink_gb_s", "GB/s", "add it")


def test_an_unknown_name_lists_the_profiles() -> None:
    with pytest.raises(HardwareError) as error:
        load_hardware("h100")
    one_line_error(error, "unknown hardware 'h100'", *BUILT_IN)
    with pytest.raises(HardwareError) as error:
        load_hardware("nowhere/h100.yaml")
    one_line_error(error, "does not exist", "h100-sxm")


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
    one_line_error(error, "hardware file x.yaml", *words)


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
    one_line_error(error, "fa3", "cudnn, flash2")


def test_precisions_and_a_gpu_without_fp8() -> None:
    h100, a100 = load_hardware("h100-sxm"), load_hardware("a100-80g")
    assert h100.peak_tflops("fp8") == 1979.0 and h100.gemm_fraction(1e12, "fp8") <= 0.71
    with pytest.raises(HardwareError) as error:
        a100.peak_tflops("fp8")
    one_line_error(error, "a100-80g", "bf16")
    from cp_train.perf.rates import DeviceRates  # the rates check the precision once, at the boundary

    with pytest.raises(HardwareError):
        DeviceRates(h100, "fp16")
    with pytest.raises(HardwareError) as error:
        DeviceRates(a100, "fp8")
    one_line_error(error, "a100-80g", "no fp8 peak")


# exact counts of the released checkpoints (HF safetensors totals); Qwen2.5-7B's less its 129,024 q/k/v biases
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
