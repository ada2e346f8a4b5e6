"""The planner on CPU: a quick calibration writes a profile that loads and plans, a CPU profile's rates scale with
the ranks sharing the cores, the host-op count matches what the model dispatches, and bad CPU sections fail in
one line. Timings are not asserted (a shared machine varies 10-20%): ``bench/planner.py`` compares them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from cp_train.config.sources import load_config
from cp_train.plan.calibration.calibrate import OpCounter, write_profile
from cp_train.plan.cli import main
from cp_train.plan.host_ops import LAYER
from cp_train.plan.inputs.hardware import HardwareError, from_dict, load_hardware
from cp_train.plan.predict import predict
from cp_train.plan.rates import DeviceRates
from cp_train.plan.workload import KernelCall

ROOT = Path(__file__).resolve().parents[1]
CPU_TINY = ROOT / "launch" / "configs" / "cpu-tiny.yaml"


def cpu_profile(**cpu: object) -> dict:
    """A CPU profile's mapping (made-up rates: 100 GFLOP/s per core, 2 cores)."""
    section = {"cores": 2, "thread_speedup": 1.8, "op_overhead_us": 4.0, "shared_efficiency": 0.9,
               "collectives": [[2, 2.0, 100.0, 150.0], [4, 1.0, 400.0, 1500.0]],
               "attention_calls": [[2, "ring", 1, 3000.0], [2, "ring", 2, 5000.0], [4, "ring", 1, 15000.0],
                                   [4, "ring", 2, 25000.0]]}
    section.update(cpu)
    return {"name": "cpu-test", "bf16_tflops": 0, "fp8_tflops": 0, "hbm_gib": 16, "hbm_tb_s": 0.013,
            "nvlink_gb_s": 2.0, "nvlink_efficiency": 1.0, "nvlink_latency_us": 100.0, "net_gb_s": 2.0,
            "net_efficiency": 1.0, "net_latency_us": 100.0, "collective_latency_us": 150.0, "gemm_bf16": [],
            "gemm_fp8": [], "attention": [{"kernel": "torch", "head_dim": 32, "causal": True,
                                           "points": [[64, 0.2], [1024, 0.4]]}],
            "attention_kernel": "torch", "gpus_per_node": 1024, "compute_dtype": "fp32", "fp32_tflops": 0.1,
            "gemm_fp32": [[1e6, 0.5], [1e9, 0.9]], "cpu": section}


def tiny_run(**overrides: object):  # noqa: ANN201 - a Config
    """cpu-tiny (one document per sample) with ``overrides``."""
    values = {"data.document_mask": False, "logging.wandb": False, **overrides}
    return load_config(CPU_TINY, overrides=[f"{key}={value}" for key, value in values.items()])


def test_a_quick_calibration_writes_a_profile_that_loads_and_plans(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    written = write_profile(path, quick=True)
    hardware = load_hardware(str(path))
    assert hardware == written and hardware.compute_dtype == "fp32" and hardware.cpu is not None
    assert hardware.fp32_tflops > 0 and hardware.peak_tflops("fp32") == hardware.fp32_tflops
    assert hardware.attention_kernel == "torch" and 0 < hardware.attention_fraction(32, 256) <= 1
    assert hardware.cpu.cores >= 1 and [link[0] for link in hardware.cpu.collectives] == [2]
    assert 0 < hardware.cpu.adamw_bytes < 1000  # the trainer's AdamW, as bytes per parameter at the copy rate
    assert {call[1] for call in hardware.cpu.attention_calls} == {"ring", "allgather", "ulysses"}
    assert {row[1] for row in hardware.cpu.attention_in_step} == {"ring", "allgather", "ulysses"}
    prediction = predict(tiny_run(), 2, DeviceRates(hardware), hardware.fp32_tflops, hardware.hbm_gib, 0.0)
    parts = prediction.record()["breakdown_s"]
    assert prediction.step_time_s > 0 and parts["host"] > 0 and parts["cp_comm"] > 0


def test_cpu_rates_scale_with_the_ranks_sharing_the_cores() -> None:
    hardware = from_dict(cpu_profile())
    one = DeviceRates(hardware, world=1)
    rates = {world: one.at_world(world) for world in (1, 2, 4, 8)}
    matmul = {world: r.matmul(512, 512, 512) for world, r in rates.items()}
    assert matmul[1] == pytest.approx(1.8 * 0.1e12 * hardware.gemm_fraction(2 * 512**3, "fp32"))  # two threads
    assert matmul[2] == pytest.approx(0.9 * matmul[1] / 1.8)  # a thread each, sharing the memory
    assert matmul[4] == pytest.approx(matmul[2] / 2) and matmul[8] == pytest.approx(matmul[2] / 4)
    call = KernelCall(256, 256, True)
    assert rates[4].attention(call, 32) == pytest.approx(rates[2].attention(call, 32) / 2)
    assert rates[4].memory_bytes_per_s == pytest.approx(rates[2].memory_bytes_per_s / 2)
    assert rates[2].op_seconds == one.op_seconds == 4e-6 and rates[8].op_seconds == pytest.approx(16e-6)
    assert rates[2].link(False) == pytest.approx((2e9, 1e-4)) and rates[4].link(True) == pytest.approx((1e9, 4e-4))
    assert one.at_world(3).link(False)[0] == pytest.approx(1.5e9)  # between the measured worlds
    assert rates[4].cp_call_seconds("ring", 4, 3) == pytest.approx(0.035)  # linear in the chunks
    # a pair in a world of 4 on 2 cores: a pair alone (its world of 2), twice as slow with twice the ranks per core
    assert rates[4].cp_call_seconds("ring", 2, 1) == pytest.approx(2 * 0.003)
    assert rates[2].cp_call_seconds("ring", 2, 1) == pytest.approx(0.003)
    gpu = DeviceRates(load_hardware("h100-sxm"))
    assert gpu.at_world(64) is gpu and gpu.op_seconds == 0 and gpu.cpu_threads == 0


def test_the_same_work_per_rank_takes_longer_on_more_ranks_than_cores() -> None:
    hardware = from_dict(cpu_profile())
    steps = {}
    for cp in (2, 4):  # the same tokens per rank: seq 128 per rank
        config = tiny_run(**{"parallel.cp": cp, "data.seq_len": 128 * cp, "model.max_position_embeddings": 512})
        prediction = predict(copy.deepcopy(config), cp, DeviceRates(hardware), 0.1, 16.0, 0.0)
        steps[cp] = prediction.record()["breakdown_s"]
    assert steps[4]["matmuls"] == pytest.approx(2 * steps[2]["matmuls"], rel=0.02)  # 4 ranks on 2 cores
    assert steps[4]["host"] > 1.9 * steps[2]["host"] and steps[4]["cp_comm"] > steps[2]["cp_comm"]


def test_the_host_op_count_of_a_block_matches_the_model() -> None:
    """``host_ops.LAYER`` against a dispatch count of the model's blocks (cp 1, forward + backward)."""
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel

    counts = []
    for layers in (1, 3):
        config = ModelConfig(vocab_size=64, num_layers=layers, hidden_size=32, num_heads=4, num_kv_heads=2,
                             ffn_hidden_size=64, max_position_embeddings=16, tie_embeddings=True)
        model, tokens = GPTModel(config), torch.randint(0, 64, (2, 16))
        model(tokens, labels=tokens).sum().backward()
        with OpCounter() as counter:
            model(tokens, labels=tokens).sum().backward()
        counts.append(counter.ops)
    assert (counts[1] - counts[0]) / 2 == pytest.approx(LAYER, rel=0.15)


def test_the_command_line_plans_a_cpu_layout_from_a_profile_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(from_dict(cpu_profile()).to_yaml())
    assert main([str(CPU_TINY), "--seq-len", "256", "--gpus", "2", "--global-batch-tokens", "2048", "--hardware",
                 str(path), "--cp", "2", "--cp-algorithm", "ring", "--no-fsdp",
                 "--activation-checkpointing", "none", "--micro-batch", "4", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records and all(r["cp"] == 2 and r["breakdown_s"]["host"] > 0 for r in records)


@pytest.mark.parametrize("change, words", [
    ({"cores": 0}, ("cpu.cores", "integer >= 1")),
    ({"thread_speedup": 3.0}, ("cpu.thread_speedup", "between 1 and cpu.cores")),
    ({"shared_efficiency": 1.5}, ("cpu.shared_efficiency", "fraction")),
    ({"attention_calls": [[2, "hybrid", 1, 10.0]]}, ("cpu.attention_calls", "ring, allgather, ulysses")),
    ({"collectives": []}, ("cpu.collectives", "non-empty")),
    ({"tp_in_step": []}, ("unknown key(s) tp_in_step", "remove them")),
    ({"attention_calls": None}, ("cpu lacks attention_calls", "--calibrate")),
])
def test_a_bad_cpu_section_names_the_key(change: dict, words: tuple[str, ...]) -> None:
    profile = cpu_profile(**change)
    profile["cpu"] = {key: value for key, value in profile["cpu"].items() if value is not None}  # None: left out
    with pytest.raises(HardwareError) as error:
        from_dict(profile, "hardware file cpu.yaml")
    message = str(error.value)
    assert "\n" not in message and "hardware file cpu.yaml" in message
    for word in words:
        assert word in message, (word, message)


def test_a_measured_linear_grid_sets_the_rate_by_shape() -> None:
    """``cpu.linears``: the measured fraction at a grid point, log-linear between points, the FLOPs curve for a
    point not measured, and the FLOPs curve alone without a grid."""
    grid = [[m, k, n, 0.5 if k == 64 else 0.8] for m in (256, 1024) for k in (64, 256) for n in (256, 1024)]
    grid.remove([1024, 256, 1024, 0.8])  # too large to time: the FLOPs curve fills it
    hardware = from_dict(cpu_profile(linears=grid))
    assert from_dict(hardware.to_dict()) == hardware  # round trips
    rates, plain = DeviceRates(hardware), DeviceRates(from_dict(cpu_profile()))
    peak = 1.8 * 0.1e12
    assert rates.matmul(256, 1024, 64) == pytest.approx(0.5 * peak)  # matmul(m, n, k): k = 64 in features
    assert rates.matmul(256, 1024, 256) == pytest.approx(0.8 * peak)
    assert rates.matmul(256, 1024, 128) == pytest.approx(0.65 * peak)  # halfway in log2(k)
    missing = hardware.gemm_fraction(2.0 * 1024 * 256 * 1024, "fp32")
    assert rates.matmul(1024, 1024, 256) == pytest.approx(missing * peak)
    assert rates.matmul(64, 4096, 16) == pytest.approx(0.5 * peak)  # clamped to the grid's edges
    assert plain.matmul(256, 1024, 64) == pytest.approx(peak * hardware.gemm_fraction(2.0 * 256 * 1024 * 64, "fp32"))
    with pytest.raises(HardwareError, match="cpu.linears"):
        from_dict(cpu_profile(linears=[[256, 64, 0.5]]))


def test_fsdp_on_cpu_gathers_and_reduces_the_root_too() -> None:
    """FSDP's time on CPU ranks counts every unit, the root (embedding and head) included, with its copies: a
    larger vocabulary adds to it, and it exceeds DDP's one all-reduce at this size."""
    hardware = from_dict(cpu_profile())
    seconds = {}
    for vocab in (1024, 8192):
        for fsdp in (True, False):
            config = tiny_run(**{"parallel.fsdp": fsdp, "model.vocab_size": vocab})
            prediction = predict(copy.deepcopy(config), 2, DeviceRates(hardware), 0.1, 16.0, 0.0)
            seconds[vocab, fsdp] = prediction.record()["breakdown_s"]["data_comm"]
    assert seconds[8192, True] > seconds[1024, True] > seconds[1024, False] > 0
    assert seconds[8192, True] > seconds[8192, False]


def test_collectives_fitted_by_kind_price_each_kind_apart() -> None:
    """``cpu.collective_kinds``: a kind with its own fit uses it (interpolated in the world size), other kinds the
    ``collectives`` fit; TP's gathers and reduce-scatters cost more when their kinds are slower."""
    kinds = [[2, "all_gather", 0.5, 200.0, 300.0], [4, "all_gather", 0.25, 1000.0, 500.0],
             [2, "reduce_scatter", 0.5, 200.0, 300.0], [4, "reduce_scatter", 0.25, 1000.0, 500.0]]
    plain, fitted = from_dict(cpu_profile()), from_dict(cpu_profile(collective_kinds=kinds))
    assert from_dict(fitted.to_dict()) == fitted
    rates = DeviceRates(fitted, world=4)
    flat = lambda link: (*link[0], link[1])  # noqa: E731
    assert flat(rates.kind_link("all_gather", False)) == pytest.approx((0.25e9, 1e-3, 5e-4))
    assert flat(DeviceRates(fitted, world=3).kind_link("all_gather", False)) == pytest.approx((0.375e9, 6e-4, 4e-4))
    assert rates.kind_link("all_to_all", False) == (rates.link(False), rates.call_latency_s)
    config = tiny_run(**{"parallel.tp": 2, "parallel.cp": 2})
    tp = {name: predict(copy.deepcopy(config), 4, DeviceRates(hardware), 0.1, 16.0, 0.0).breakdown.tp_comm
          for name, hardware in (("plain", plain), ("fitted", fitted))}
    assert tp["fitted"] > tp["plain"] > 0
    with pytest.raises(HardwareError, match="cpu.collective_kinds"):
        from_dict(cpu_profile(collective_kinds=[[2, "broadcast", 1.0, 1.0, 1.0]]))


def test_a_measured_cost_per_byte_of_the_cp_op_adds_to_its_calls() -> None:
    """``cpu.attention_bytes``: the CP op's cost beyond its negligible-size call grows with the call's bytes and
    with the group's ranks; without it the op costs its calls and bytes as before."""
    per_mib = [[2, "ulysses", 2000.0], [4, "ulysses", 6000.0], [2, "ring", 1000.0], [4, "ring", 3000.0]]
    plain, fitted = from_dict(cpu_profile()), from_dict(cpu_profile(attention_bytes=per_mib))
    assert from_dict(fitted.to_dict()) == fitted
    assert fitted.cpu.attention_byte_us("ulysses", 4, 4) == 6000.0
    assert fitted.cpu.attention_byte_us("ring", 4, 2) == pytest.approx(2 * 1000.0)  # a pair, ranks 2x the cores
    assert fitted.cpu.attention_byte_us("allgather", 4, 4) == 0.0
    comm = {}
    for seq in (256, 512):
        config = tiny_run(**{"parallel.cp_algorithm": "ulysses", "data.seq_len": seq})
        for name, hardware in (("plain", plain), ("fitted", fitted)):
            prediction = predict(copy.deepcopy(config), 2, DeviceRates(hardware), 0.1, 16.0, 0.0)
            comm[name, seq] = prediction.breakdown.cp_comm
    extra = {seq: comm["fitted", seq] - comm["plain", seq] for seq in (256, 512)}
    assert extra[256] > 0 and extra[512] == pytest.approx(2 * extra[256])


def test_a_measured_adamw_step_prices_the_optimizer() -> None:
    """``cpu.adamw_bytes``: the optimizer costs the measured bytes per parameter at the rank's memory rate (FSDP:
    of its shard); without it the fused kernel's 28 B; the quick calibration measures it."""
    plain, fitted = from_dict(cpu_profile()), from_dict(cpu_profile(adamw_bytes=9.0))
    assert from_dict(fitted.to_dict()) == fitted and plain.cpu.adamw_bytes == 0.0
    seconds = {}
    for name, hardware in (("plain", plain), ("fitted", fitted)):
        for fsdp in (False, True):
            config = tiny_run(**{"parallel.fsdp": fsdp})
            prediction = predict(copy.deepcopy(config), 2, DeviceRates(hardware), 0.1, 16.0, 0.0)
            seconds[name, fsdp] = prediction.breakdown.optimizer
    for fsdp in (False, True):
        assert seconds["plain", fsdp] > 0 and seconds["fitted", fsdp] == pytest.approx(seconds["plain", fsdp] * 9 / 28)
    assert seconds["plain", True] == pytest.approx(seconds["plain", False] / 2)  # a shard of two
    with pytest.raises(HardwareError, match="cpu.adamw_bytes"):
        from_dict(cpu_profile(adamw_bytes=-1.0))


def test_a_measured_in_step_cost_adds_to_every_cp_call() -> None:
    """``cpu.attention_in_step``: each CP attention op call of a step (one per layer and micro-batch, forward and
    backward together) costs its measured extra between GEMMs; a smaller group its own world's, slowed as the world
    outnumbers the cores beyond it."""
    in_step = [[2, "ring", 1000.0], [4, "ring", 6000.0]]
    plain, fitted = from_dict(cpu_profile()), from_dict(cpu_profile(attention_in_step=in_step))
    assert from_dict(fitted.to_dict()) == fitted and not plain.cpu.attention_in_step
    assert fitted.cpu.attention_in_step_us("ring", 4, 4) == 6000.0
    assert fitted.cpu.attention_in_step_us("ring", 4, 2) == pytest.approx(2 * 1000.0)  # a pair, ranks 2x the cores
    assert fitted.cpu.attention_in_step_us("ulysses", 4, 4) == 0.0
    config = tiny_run(**{"model.activation_checkpointing": "none"})
    comm = {name: predict(copy.deepcopy(config), 2, DeviceRates(hardware), 0.1, 16.0, 0.0).breakdown.cp_comm
            for name, hardware in (("plain", plain), ("fitted", fitted))}
    calls = config.model.num_layers * config.train.global_batch_size // config.train.micro_batch_size
    assert comm["fitted"] - comm["plain"] == pytest.approx(calls * 1e-3)
    with pytest.raises(HardwareError, match="cpu.attention_in_step"):
        from_dict(cpu_profile(attention_in_step=[[2, "hybrid", 1.0]]))
