"""A run directory never loses a run's metrics (``cp_train/metrics/writers.py``): a fresh run into a
``logging.dir`` that holds a ``metrics.jsonl`` moves it aside to ``metrics.<time>.jsonl`` and says so in one line;
a resumed run appends (dropping only the records of the steps it redoes)."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from cp_train.metrics.writers import METRICS_FILE, MetricWriters, SinkSettings, set_aside
from tests import trainer_cases
from tests.entry_points import run, write_config


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(run_dir: Path, steps: range, append: bool = False, first_step: int = 0) -> str:
    stream = io.StringIO()
    writers = MetricWriters(SinkSettings(run_dir=run_dir, run_name="r", total_steps=10, first_step=first_step,
                                         append=append), stream=stream)
    for step in steps:
        writers.log({"kind": "event", "step": step, "event": "x"})
    writers.close()
    return stream.getvalue()


def test_a_fresh_run_moves_the_old_metrics_aside_and_a_resume_appends(tmp_path: Path) -> None:
    first = _write(tmp_path, range(1, 6))
    assert "moved to" not in first
    metrics = tmp_path / METRICS_FILE
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(metrics.stat().st_mtime))
    second = _write(tmp_path, range(1, 3))
    kept = tmp_path / f"metrics.{stamp}.jsonl"
    assert [r["step"] for r in _records(kept)] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in _records(metrics)] == [1, 2]
    notes = [line for line in second.splitlines() if "moved to" in line]
    assert notes == [f"[cp-train] {metrics} held an earlier run's metrics: moved to {kept.name} (this run starts a "
                     f"new file; to continue that run, resume it with --load)"]
    resumed = _write(tmp_path, range(2, 4), append=True, first_step=1)  # resumed at step 1: step 2 is redone
    assert "moved to" not in resumed and [r["step"] for r in _records(metrics)] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.glob("metrics*.jsonl")) == sorted([METRICS_FILE, kept.name])


def test_set_aside_keeps_every_copy_and_skips_empty_files(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    assert set_aside(path) is None
    path.write_text("")
    assert set_aside(path) is None and path.exists()
    moved = []
    for text in ("a\n", "b\n", "c\n"):
        path.write_text(text)
        os.utime(path, (1_800_000_000, 1_800_000_000))  # the same second each time
        moved.append(set_aside(path))
    assert [p.read_text() for p in moved] == ["a\n", "b\n", "c\n"] and not path.exists()
    assert moved[1].name == moved[0].name.replace(".jsonl", "-2.jsonl")
    assert moved[2].name == moved[0].name.replace(".jsonl", "-3.jsonl")


def test_rerunning_train_py_into_the_same_directory_keeps_the_first_runs_records(tmp_path: Path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", corpus, run_dir, **{"train.steps": 4, "schedule.warmup_steps": 1})
    first = run(["--config", str(config)])
    assert first.returncode == 0, first.output[-3000:]
    records = (run_dir / METRICS_FILE).read_text()
    second = run(["--config", str(config), "--train-steps", "2"])
    assert second.returncode == 0, second.output[-3000:]
    moved = [line for line in second.output.splitlines() if "held an earlier run's metrics" in line]
    assert len(moved) == 1, second.output[-3000:]
    kept = list(run_dir.glob("metrics.*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == records and kept[0].name in moved[0]
    assert [r["step"] for r in _records(run_dir / METRICS_FILE) if r.get("kind") == "train"] == [1, 2]
