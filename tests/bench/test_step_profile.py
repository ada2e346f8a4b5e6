"""``bench/step_profile.py``: the busy time read from a scheduled profile, on CPU."""

from __future__ import annotations

import os

import pytest

from bench import step_profile
from cp_train import trainer
from cp_train.cli.train import main


def test_the_union_of_intervals_counts_overlaps_once() -> None:
    busy, span = step_profile.union_seconds([(0, 10), (5, 15), (20, 30), (22, 25), (40, 41)])
    assert busy == pytest.approx(26e-6) and span == pytest.approx(41e-6)
    assert step_profile.union_seconds([]) == (0.0, 0.0)


def test_a_scheduled_profile_of_real_steps(tmp_path, monkeypatch) -> None:
    """Two steps recorded after one skipped and one warm-up: the busy time is most of each step on CPU (the
    loop's own ops), the idle fraction a fraction, the step a real step's length."""
    reports = []
    monkeypatch.setattr(trainer.Trainer, "_step", step_profile.profiled_steps(
        trainer.Trainer._step, 1, 2, lambda events, cuda, steps: reports.append(
            (step_profile.summary(events, cuda, steps), step_profile.longest(events, cuda)))))
    assert main(["--config", "launch/configs/cpu-tiny.yaml", "--cp-size", "1", "--train-steps", "5",
                 "--set", f"logging.dir={tmp_path}", "--set", "schedule.warmup_steps=1", "--set", "model.num_layers=1",
                 "--set", "logging.wandb=false"]) == 0
    (record, top), = reports
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # the one-process world leaves nothing behind
    assert record["device"] == "cpu" and record["steps"] == 2 and record["step_s"] > 0.01
    assert 0.5 * record["step_s"] < record["busy_s"] <= record["step_s"] and 0 <= record["idle_fraction"] < 0.5
    assert any("attention" in name for name, _ in top)
