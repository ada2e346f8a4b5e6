"""Checkpoints written behind training (``checkpoint.async_save``): the write overlaps the next steps, the
checkpoint resumes bitwise, and a write that fails stops the run at the next save on every rank.

A (1, 2, 1) run saves every 2 steps in the background and stops after step 4 (the run waits for its last save).
Step 2's write is held until step 4's gradients exist, which a save in the step could never see: steps 3 and 4
update the parameters while it is written, and resuming from it must still give the uninterrupted losses.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cp_train.checkpoint.files import LATEST, step_dir_name
from cp_train.parallel.mesh.state import run_with_parallel
from tests import async_checkpoint_cases, trainer_cases

STEPS, LAYOUT = 8, (1, 2, 1)
BEHIND = {"train.steps": STEPS, "checkpoint.async_save": True, "checkpoint.interval": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module")
def saved(spawn_world, corpus, tmp_path_factory) -> dict:
    """The uninterrupted run's losses and the first 4 steps saved behind training (step 2's write held)."""
    root, world = tmp_path_factory.mktemp("async"), spawn_world(2)
    uninterrupted = world.run(run_with_parallel, LAYOUT, trainer_cases.train_layout, corpus, str(root / "whole"),
                              {"train.steps": STEPS})[0]["losses"]
    first = world.run(run_with_parallel, LAYOUT, async_checkpoint_cases.written_behind, corpus, str(root / "first"),
                      {**BEHIND, "checkpoint.save": str(root / "ckpt")}, 4, ())
    return {"losses": uninterrupted, "first": first, "checkpoints": root / "ckpt"}


def test_the_write_runs_behind_the_next_step_and_the_run_ends_with_it_complete(saved) -> None:
    checkpoints, first = saved["checkpoints"], saved["first"]
    assert [rank["behind"] for rank in first] == [True, True], "steps 3-4 did not run while step 2 was written"
    assert [rank["error"] for rank in first] == ["", ""]
    assert (checkpoints / LATEST).read_text().strip() == step_dir_name(4)
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == [step_dir_name(2), step_dir_name(4)]
    for step in (2, 4):
        line = next(m for m in first[0]["messages"] if step_dir_name(step) in m)
        assert re.fullmatch(rf"saved checkpoint {re.escape(str(checkpoints / step_dir_name(step)))} \(written behind "
                            r"training in \d+\.\d s; the step waited \d+\.\d\d s for the copy to host memory\)", line)
    assert first[0]["losses"] == {step: saved["losses"][step] for step in range(1, 5)}


def test_a_checkpoint_written_while_later_steps_ran_resumes_bitwise(spawn_world, saved, corpus,
                                                                    tmp_path: Path) -> None:
    """Step 2's checkpoint holds the state of step 2, not of the steps that ran while it was written."""
    load = saved["checkpoints"] / step_dir_name(2)
    resumed = spawn_world(2).run(run_with_parallel, LAYOUT, trainer_cases.train_layout, corpus, str(tmp_path),
                                 {"train.steps": STEPS, "checkpoint.load": str(load)})[0]
    assert resumed["step_at_start"] == 2
    assert resumed["losses"] == {step: saved["losses"][step] for step in range(3, STEPS + 1)}


@pytest.mark.parametrize("failing, stopped_at", [(4, 6), (STEPS, STEPS)])
def test_a_write_that_fails_behind_training_stops_the_run_at_the_next_save_or_its_end(spawn_world, corpus,
                                                                                        tmp_path: Path, failing: int,
                                                                                        stopped_at: int) -> None:
    """The failure is raised where the run next waits for the save: the next save's step, or the run's end."""
    checkpoints = tmp_path / "ckpt"
    ranks = spawn_world(2).run(run_with_parallel, LAYOUT, async_checkpoint_cases.failing_behind, corpus,
                               str(tmp_path / "run"), {**BEHIND, "checkpoint.save": str(checkpoints)}, failing, 1)
    target, previous = checkpoints / step_dir_name(failing), step_dir_name(failing - 2)
    expected = (f"RunFailure: saving checkpoint {target} failed (OSError: simulated failure of rank 1 writing "
                f"{step_dir_name(failing)}); {checkpoints / LATEST} still names {previous}")
    assert [rank["error"] for rank in ranks] == [expected, expected]
    assert [rank["step"] for rank in ranks] == [stopped_at, stopped_at]
    assert (checkpoints / LATEST).read_text().strip() == previous


def test_a_write_failing_while_the_run_fails_is_reported_beside_the_runs_error(spawn_world, corpus,
                                                                               tmp_path: Path) -> None:
    """The run stops with its own error; the save in flight is still completed, and its failure is a message."""
    checkpoints = tmp_path / "ckpt"
    ranks = spawn_world(2).run(run_with_parallel, LAYOUT, async_checkpoint_cases.failing_beside_the_run, corpus,
                               str(tmp_path / "run"), {**BEHIND, "checkpoint.save": str(checkpoints)}, 4)
    assert [rank["error"] for rank in ranks] == ["RuntimeError: simulated failure of step 5"] * 2
    expected = (f"the checkpoint written behind training failed as well: saving checkpoint "
                f"{checkpoints / step_dir_name(4)} failed (OSError: simulated failure of rank 1 writing "
                f"{step_dir_name(4)}); {checkpoints / LATEST} still names {step_dir_name(2)}")
    assert [rank["messages"][-1] for rank in ranks] == [expected, expected]
    assert (checkpoints / LATEST).read_text().strip() == step_dir_name(2)
