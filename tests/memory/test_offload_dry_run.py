"""The dry run and the planner with ``model.activation_offload`` (``cp_train/memory/offload.py``): the 1M-token
recipe fits 8 x 80 GB with offload and not without (the hint names it), a node's host memory is checked against
the profile's ``host_memory_gib``, PCIe copies are exposed only where they outlast a block's compute, and on CPU
offload saves nothing (the plan there against the live bytes of real steps). The bytes moved are checked against
the mechanism's in ``tests/model/test_offload.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from bench import dry_run_check
from cp_train.config.schema import Config
from cp_train.config.sources import load_config
from cp_train.memory.dry_run import GIB, memory_plan
from cp_train.memory.offload import pinned
from cp_train.parallel.mesh.state import ParallelDims
from cp_train.perf.inputs.hardware import PROFILES_DIR
from cp_train.perf.run_check import run_prediction
from cp_train.perf.time_model import offload_seconds
from tests import trainer_cases
from train import main as train_main

RECIPE = "launch/configs/gpt-8b-1m-cp8.yaml"
DRY_RUN = ["--config", RECIPE, "--dry-run", "--device-memory-gib", "80"]


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_the_1m_recipe_fits_8_x_80_gb_with_offload_and_names_its_host_memory_and_speed(capsys) -> None:
    assert train_main(DRY_RUN) == 0
    lines = _lines(capsys)
    assert lines[0].startswith(f"dry run of {RECIPE}: 8,030,261,248 parameters, world 8 = tp 1 x cp 8 x dp 1")
    assert "131,072 tokens per rank per micro-batch" in lines[0]
    offload = next(line for line in lines if line.startswith("activation offload checkpointed: 31 blocks move"))
    assert "(the block input and the CP attention's q, k, v, output, lse) to pinned host memory" in offload
    host = next(line for line in lines if line.startswith("host memory:"))
    assert host.startswith("host memory: 109 GiB per rank, 872 GiB per node of 8 rank(s) of 1638 GiB usable (80% of "
                           "2048 GiB, h100-sxm's host_memory_gib)"), host
    planner = next(line for line in lines if line.startswith("planner (h100-sxm"))
    assert "tokens/s per device (" in planner and planner.endswith(
        "activation offload over PCIe at 55 GB/s: hidden behind each block's compute"), planner
    assert lines[-1].startswith("fits: the largest rank (0) needs 40.3 GiB of 73.0 GiB usable"), lines[-1]


def test_without_offload_the_recipe_does_not_fit_and_the_hint_names_offload(capsys) -> None:
    assert train_main([*DRY_RUN, "--set", "model.activation_offload=none"]) == 1
    lines = _lines(capsys)
    assert not any(line.startswith(("activation offload", "host memory")) for line in lines)
    assert lines[-2].startswith("does NOT fit: the largest rank (0) needs 146 GiB of 73.0 GiB usable"), lines[-2]
    assert lines[-1].startswith("to fit: model.activation_checkpointing=full; model.activation_offload=checkpointed "
                                "(what checkpointing keeps to pinned host memory"), lines[-1]
    assert train_main([*DRY_RUN, "--set", "model.activation_offload=none", "--set",
                       "model.activation_checkpointing=full"]) == 0  # full alone: no room left
    assert _lines(capsys)[-1].startswith("fits: the largest rank (0) needs 68.9 GiB of 73.0 GiB usable per device "
                                         "(94%)")
    assert train_main([*DRY_RUN, "--set", "model.activation_offload=none", "--set",
                       "model.activation_checkpointing=full", "--device-memory-gib", "75"]) == 1
    assert _lines(capsys)[-1].startswith("to fit: model.activation_offload=checkpointed")


def test_a_node_without_the_host_memory_is_a_failed_dry_run_that_says_what_to_change(tmp_path, capsys) -> None:
    profile = yaml.safe_load((PROFILES_DIR / "h100-sxm.yaml").read_text())
    profile.update(name="h100-1tb", host_memory_gib=1024.0)
    (tmp_path / "h100-1tb.yaml").write_text(yaml.safe_dump(profile))
    argv = [*DRY_RUN, "--set", f"logging.hardware_profile={tmp_path / 'h100-1tb.yaml'}"]
    assert train_main(argv) == 1
    lines = _lines(capsys)
    assert "of 819 GiB usable (80% of 1024 GiB, h100-1tb's host_memory_gib): does NOT fit the host" in next(
        line for line in lines if line.startswith("host memory:"))
    assert lines[-2] == "does NOT fit the host: the offloaded activations need 872 GiB per node of 819 GiB usable " \
                        "(h100-1tb's host_memory_gib)", lines[-2]
    assert lines[-1].startswith("to fit: model.activation_checkpointing=full (moves only the block inputs)")
    assert train_main([*argv, "--set", "model.activation_checkpointing=full"]) == 0  # 248 GiB per node
    assert "host memory: 31.0 GiB per rank, 248 GiB per node of 8 rank(s)" in "\n".join(_lines(capsys))
    config = load_config(RECIPE)
    config.logging.hardware_profile = str(tmp_path / "h100-1tb.yaml")
    planned, note = run_prediction(config, 8, torch.device("cpu"))  # the planner's verdict alike
    assert note is None and planned["memory_gib"] < 73 and not planned["fits"], planned


def test_the_device_keeps_the_last_block_and_a_window_and_the_host_rounds_to_powers_of_two() -> None:
    config = load_config(RECIPE)
    _, ranks, activations, assumed = memory_plan(config, 8, only=[0])
    plan = assumed["offload"]
    tokens, hidden, head_dim = 131_072, 4096, 128
    assert plan.tensors == (tokens * hidden * 2, tokens * 32 * head_dim * 2, tokens * 8 * head_dim * 2,
                            tokens * 8 * head_dim * 2, tokens * 32 * head_dim * 2, tokens * 32 * 4)
    assert plan.layers == 31 and activations["moved"] == 31 * sum(plan.tensors)
    assert activations["blocks"] == activations["window"] == sum(plan.tensors)  # the last block's; one prefetched
    assert activations["offloaded"] == 31 * sum(pinned(t) for t in plan.tensors)
    assert pinned(3 * 2**20 + 1) == 4 * 2**20 and pinned(2**20) == 2**20
    off = memory_plan(_without_offload(config), 8, only=[0])
    assert off[2]["blocks"] == 32 * sum(plan.tensors) and off[2]["window"] == off[2]["offloaded"] == 0
    saved = off[1][0].activation_bytes - ranks[0].activation_bytes
    assert saved == 32 * sum(plan.tensors) - 2 * sum(plan.tensors), saved / GIB  # 30 blocks' tensors


def test_on_cpu_offload_saves_nothing_in_the_plan() -> None:
    config = load_config(RECIPE)
    config.parallel.backend = "gloo"
    cpu = memory_plan(config, 8, only=[0])
    none = memory_plan(_without_offload(config), 8, only=[0])
    assert cpu[2]["blocks"] == none[2]["blocks"] and cpu[2]["window"] > 0  # the prefetched block's second copy
    assert cpu[2]["offloaded"] == cpu[2]["moved"]  # no pinned rounding on CPU


@pytest.mark.parametrize(("checkpointing", "mode"), [("selective", "checkpointed"), ("none", "all")])
def test_on_cpu_the_planned_peak_with_offload_is_the_measured_one(spawn_world, tmp_path, checkpointing, mode) -> None:
    """The tiny run at cp 2 on gloo (the host copies and the prefetched block in the same memory): the planned
    peak within 10% of the live tensor bytes of a real step (``bench/dry_run_check.py``; 1-2% when written)."""
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    config = trainer_cases.tiny_config(corpus, str(tmp_path / "run"), ParallelDims(tp=1, cp=2, dp=1), **{
        "parallel.backend": "gloo", "model.activation_checkpointing": checkpointing, "model.activation_offload": mode})
    record = dry_run_check.compare(spawn_world(2), config, f"{checkpointing}-{mode}")
    assert abs(record["ratio"] - 1) <= 0.10, record


def test_pcie_copies_are_exposed_only_beyond_a_blocks_compute() -> None:
    gb = 1e9
    assert offload_seconds(55 * gb, 31, 2.0, 5.0, 55 * gb) == 0.0  # 1 s per copy behind 2 s and 5 s
    assert offload_seconds(55 * gb, 31, 0.5, 5.0, 55 * gb) == 31 * 0.5  # the forward's copies outlast it
    assert offload_seconds(0, 31, 0.5, 5.0, 55 * gb) == offload_seconds(55 * gb, 0, 0.5, 5.0, 55 * gb) == 0.0


def test_a_slow_host_link_shows_in_the_planned_step(tmp_path, capsys) -> None:
    profile = yaml.safe_load((PROFILES_DIR / "h100-sxm.yaml").read_text())
    profile.update(name="h100-slow-pcie", pcie_gb_s=0.5)
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(profile))
    step, slow = {}, [*DRY_RUN, "--set", f"logging.hardware_profile={tmp_path / 'slow.yaml'}"]
    for name, argv in (("h100-sxm", DRY_RUN), ("h100-slow-pcie", slow)):
        assert train_main(argv) == 0
        planner = next(line for line in _lines(capsys) if line.startswith(f"planner ({name}"))
        step[name] = float(planner.split(" tokens in ")[1].split(" s ")[0])
    exposed = float(planner.split("GB/s: ")[1].split(" s exposed")[0])
    # 31 blocks move 3.78 GB each way: 7.6 s per copy at 0.5 GB/s, against ~2.5 s of a block's forward and ~5 s of
    # its backward; the step grows by what is exposed (three significant figures printed)
    assert 31 * 2 * (7.5 - 5.5) < exposed < 31 * 2 * 7.6, planner
    assert abs(step["h100-slow-pcie"] - step["h100-sxm"] - exposed) <= 1.5, (step, exposed)


def _without_offload(config: Config) -> Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, activation_offload="none"))


def test_async_checkpoints_add_a_host_copy_of_the_state_to_the_host_check(tmp_path, capsys) -> None:
    """``checkpoint.async_save`` keeps each rank's parameters and optimizer state in host memory for the run: the
    dry run and the planner count them with the offload, and a host that cannot hold both says so."""
    argv = [*DRY_RUN, "--set", "checkpoint.async_save=true"]
    assert train_main(argv) == 0
    lines = _lines(capsys)
    copy = next(line for line in lines if line.startswith("checkpoint.async_save:"))
    config = load_config(RECIPE)
    config.checkpoint.async_save = True
    _, ranks, _, _ = memory_plan(config, 8)
    state = ranks[0].parameter_bytes + ranks[0].optimizer_bytes
    assert f"state, {state / GIB:.3g} GiB per rank, kept for the run" in copy, copy
    host = next(line for line in lines if line.startswith("host memory:"))
    assert host.startswith(f"host memory: {(109.0 * GIB + state) / GIB:.3g} GiB per rank"), host  # 109 offloaded
    profile = yaml.safe_load((PROFILES_DIR / "h100-sxm.yaml").read_text())
    profile.update(name="h100-1tb", host_memory_gib=1100.0)  # 880 usable: the offload's 872 GiB per node fit alone
    (tmp_path / "h100-1tb.yaml").write_text(yaml.safe_dump(profile))
    assert train_main([*argv, "--set", f"logging.hardware_profile={tmp_path / 'h100-1tb.yaml'}"]) == 1
    lines = _lines(capsys)
    assert lines[-2].startswith("does NOT fit the host: the offloaded activations and the checkpoint copy need "), lines
    assert lines[-1].endswith("; checkpoint.async_save=false"), lines[-1]
    config.logging.hardware_profile = str(tmp_path / "h100-1tb.yaml")  # the planner's verdict alike
    assert run_prediction(config, 8, torch.device("cpu"))[0]["fits"] is False
    config.checkpoint.async_save = False
    assert run_prediction(config, 8, torch.device("cpu"))[0]["fits"] is True
