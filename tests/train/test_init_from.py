"""``checkpoint.init_from`` (``--init-from``; Megatron-LM's ``--finetune``): a new run from a cp-train checkpoint's
weights, resharded to another layout, at step 0 with a fresh optimizer, schedule and data stream; its own
checkpoints, not the one it started from, are what a rerun resumes; a model of another shape is one line."""

from __future__ import annotations

import pytest
import torch

from cp_train.checkpoint.weights import init_source
from cp_train.cli.train import check_input_files
from cp_train.config.flags import parse_args
from cp_train.config.schema import ConfigError
from cp_train.errors import InputError
from cp_train.parallel.mesh.state import ParallelDims, run_with_parallel
from tests import trainer_cases

QUIET = {"train.valid_interval": 0, "logging.interval": 2}


def test_a_new_run_starts_from_a_checkpoints_weights_in_another_layout(spawn_world, tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    world, saved = spawn_world(2), tmp_path / "stage1"

    def run(name: str, layout: tuple[int, int, int], steps: int, **overrides: object) -> dict:
        return world.run(run_with_parallel, layout, trainer_cases.train_layout, corpus, str(tmp_path / name),
                         {**QUIET, "train.steps": steps, **overrides}, None, ("params", "optimizer"))[0]

    first = run("first", (1, 2, 1), 3, **{"checkpoint.save": str(saved)})  # cp 2, zigzag
    stage = {"checkpoint.init_from": str(saved), "checkpoint.save": str(tmp_path / "stage2"),
             "model.rope_theta": 40000.0, "schedule.warmup_steps": 1}
    second = run("second", (2, 1, 1), 2, **stage)  # tp 2: the weights resharded
    assert second["step_at_start"] == 0 and second["consumed_at_start"] == 0 and sorted(second["losses"]) == [1, 2]
    start = second["start"]
    assert start["params"].keys() == first["end"]["params"].keys()
    assert all(torch.equal(start["params"][name], first["end"]["params"][name]) for name in start["params"])
    assert not [key for key in start["optimizer"] if key.endswith(".exp_avg")]  # a fresh optimizer
    assert any(m.startswith(f"initialised from the weights of checkpoint {saved / 'step_00000003'} (step 3), "
                            f"resharded to this layout") for m in second["messages"])
    assert "changed since that checkpoint: model.rope_theta 10000.0 -> 40000.0" in second["messages"]
    rerun = run("second", (2, 1, 1), 3, **stage)  # the same command, longer: resumes its own checkpoint
    assert rerun["step_at_start"] == 2 and sorted(rerun["losses"]) == [3]
    deeper = trainer_cases.tiny_config(corpus, str(tmp_path / "x"), ParallelDims(tp=1, cp=1, dp=1),
                                         **{"model.num_layers": 3})
    with pytest.raises(InputError, match=f"^checkpoint.init_from \\(--init-from\\) {saved / 'step_00000003'} holds "
                                         f"a model of another shape: model.num_layers 2 -> 3; set them as saved "
                                         f"\\(--set model.num_layers=2\\)$"):
        init_source(str(saved), deeper)


def test_no_checkpoint_two_starting_points_and_megatrons_flags_are_one_line(tmp_path) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    config = parse_args(["--init-from", str(empty)])[0]
    with pytest.raises(InputError, match=f"^checkpoint.init_from \\(--init-from\\) {empty} holds no checkpoint"):
        init_source(str(empty), config)
    config.checkpoint.init_from_hf = str(empty)
    with pytest.raises(ConfigError, match=f"^checkpoint.init_from {empty} and checkpoint.init_from_hf {empty} both "
                                          f"name the weights a new run starts from: keep one$"):
        check_input_files(config)
    with pytest.raises(ConfigError, match=r"--finetune has no alias here: use --init-from CHECKPOINT in place of "):
        parse_args(["--load", "ck", "--finetune"])
