"""Schedules that extend honestly: a resume that changes ``train.steps`` keeps the LR continuous and re-plans the
decay to ``min_lr`` at the new end (cosine, linear, wsd), and ``--restart-schedule`` restarts it (a warmup that
never ends: ``test_cli_flags``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cp_train.config.schema import OptimizerConfig, ScheduleConfig
from cp_train.optim import LRSchedule, continue_schedule, saved_schedule
from tests import trainer_cases
from tests.entry_points import run, run_many, write_config

LR, MIN_LR = 1e-3, 1e-4


def schedule(decay: str, steps: int, warmup: int = 10) -> LRSchedule:
    return LRSchedule(OptimizerConfig(lr=LR, min_lr=MIN_LR), ScheduleConfig(warmup_steps=warmup, decay=decay), steps)


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
@pytest.mark.parametrize("at", [60, 100, 95])  # mid-run, at the end of a finished run, inside wsd's decay
def test_doubled_steps_keep_the_lr_continuous_and_end_at_min_lr(decay, at) -> None:
    old, new = schedule(decay, 100), schedule(decay, 200)
    note = continue_schedule(new, old, at, restart=False)
    last_trained, following = old(at - 1), new(at)
    assert abs(following - last_trained) <= 0.01 * last_trained, (last_trained, following)
    assert new(199) == pytest.approx(MIN_LR, rel=1e-9)
    curve = [new(step) for step in range(at, 200)]
    assert all(b <= a + 1e-15 for a, b in zip(curve, curve[1:], strict=False)), "the re-planned decay rises"
    if decay == "wsd" and at == 60:  # still stable: the plain wsd of 200 steps continues it, no re-plan
        assert note is None and new.replan is None and new(150) == LR
    else:
        assert note is not None and re.search(rf"train\.steps 100 -> 200: LR schedule re-planned from step {at} "
                                              rf"\(a restart would jump to \S+; --restart-schedule does that\): lr "
                                              rf"\S+ -> \S+ at steps {at} -> {at + 1}, end lr \S+ -> 1\.00e-04 at "
                                              rf"steps 100 -> 200 \({decay}\)$", note), note
    saved = saved_schedule({"optimizer": {"lr": LR, "min_lr": MIN_LR}, "schedule": {"warmup_steps": 10, "decay": decay},
                            "train": {"steps": 200}}, new.state_dict())  # a second resume continues the re-plan
    again = schedule(decay, 200)
    assert continue_schedule(again, saved, at + 20, restart=False) is None
    assert [again(s) for s in range(at, 200)] == curve


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_an_unchanged_schedule_resumed_mid_decay_goes_on_without_a_note(decay) -> None:
    """The LR falls more than 1% from step to step here (a short run): the resume is still no restart."""
    for at in (12, 50, 95):
        old, new = schedule(decay, 100), schedule(decay, 100)
        assert continue_schedule(new, old, at, restart=False) is None
        assert [new(s) for s in range(at, 100)] == [old(s) for s in range(at, 100)]


def test_restart_schedule_restarts_and_wsd_shape() -> None:
    old, new = schedule("cosine", 100), schedule("cosine", 200)
    note = continue_schedule(new, old, 100, restart=True)
    assert new.replan is None and new(100) == schedule("cosine", 200)(100) > 5 * old(99)
    assert note == f"LR schedule restarted (--restart-schedule): lr {old(100):.2e} -> {new(100):.2e} at step 101"
    wsd = schedule("wsd", 110)  # 10 warmup, 80 stable, the last 20 (decay_fraction 0.2 of 100) decay linearly
    assert [wsd(s) for s in (9, 10, 89)] == [LR, LR, LR] and wsd(90) < LR and wsd(109) == pytest.approx(MIN_LR)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("schedule") / "docs")


def lrs(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if r.get("kind") == "train"}


def test_a_resume_with_doubled_steps_continues_the_lr_and_restart_restarts_it(corpus, tmp_path) -> None:
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", **{"train.steps": 6})
    first = run(["--config", str(config), "--save", str(tmp_path / "ckpt")])
    assert first.returncode == 0, first.output[-3000:]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt-copy")
    outcomes = run_many({
        "longer": ["--config", str(config), "--save", str(tmp_path / "ckpt"), "--train-steps", "12"],
        "restart": ["--config", str(config), "--load", str(tmp_path / "ckpt-copy"), "--train-steps", "12",
                    "--restart-schedule", "--run-dir", str(tmp_path / "restarted")],
    })
    longer = outcomes["longer"]
    assert longer.returncode == 0, longer.output[-3000:]
    notes = [line for line in longer.output.splitlines() if "LR schedule re-planned" in line]
    assert len(notes) == 1 and "train.steps 6 -> 12" in notes[0], longer.output[-3000:]
    lr = lrs(tmp_path / "run")
    assert sorted(lr) == list(range(1, 13))
    assert abs(lr[7] - lr[6]) <= 0.01 * lr[6] and lr[12] == pytest.approx(3e-4)
    restarted = outcomes["restart"]
    assert restarted.returncode == 0, restarted.output[-3000:]
    assert "LR schedule restarted (--restart-schedule)" in restarted.output
    assert lrs(tmp_path / "restarted")[7] > 2 * lr[6]
