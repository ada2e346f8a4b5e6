"""Preemption on a real 2-rank run (cp = 2, through ``cp_train.cli.launch``): SIGUSR1 to one rank saves a
checkpoint and stops the run with exit code 0; rerunning the same command resumes it with the uninterrupted run's
losses, bitwise, in the same wandb run. The records carry the max over ranks and both MFUs."""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cp_train.checkpoint.dcp import LATEST
from tests import trainer_cases
from tests.entry_points import run, signal_rank, start, wait_for_step, write_config

STEPS, SIGNAL_AT = 40, 2


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if r["kind"] == "train"}


def test_sigusr1_saves_and_exits_0_and_the_rerun_resumes_bitwise_in_the_same_wandb_run(tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", cp=2,
                          **{"train.steps": STEPS, "logging.wandb": True, "logging.wandb_mode": "offline"})
    args = ["--config", str(config), "--save", str(tmp_path / "ckpt")]
    with ThreadPoolExecutor(1) as pool:  # the reference runs beside the interrupted run
        reference = pool.submit(run, ["--config", str(config), "--run-dir", str(tmp_path / "reference"), "--set",
                                      "logging.wandb=false"], world=2, launcher="launch")
        process = start(args, world=2, launcher="launch")
        wait_for_step(tmp_path / "run" / "metrics.jsonl", SIGNAL_AT, process)
        signal_rank(process, 1, signal.SIGUSR1)
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
        stopped = re.search(r"SIGUSR1 received: stopped at step (\d+) after saving a checkpoint; rerun the same "
                            r"command to resume", output)
        assert stopped, output[-3000:]
        step = int(stopped.group(1))
        assert SIGNAL_AT <= step < STEPS and (tmp_path / "ckpt" / LATEST).read_text().strip() == f"step_{step:08d}"
        rerun = run(args, world=2, launcher="launch")
        assert rerun.returncode == 0, rerun.output[-3000:]
        assert f"resumed from {tmp_path / 'ckpt' / f'step_{step:08d}'} at step {step}" in rerun.output
        done = reference.result()
        assert done.returncode == 0, done.output[-3000:]
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")
    assert sorted(losses(tmp_path / "run")) == list(range(1, STEPS + 1))
    offline = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and len({path.name.rsplit("-", 1)[1] for path in offline}) == 1, offline
    train = [r for r in records(tmp_path / "run") if r["kind"] == "train"]
    for key in ("step_time_max_s", "peak_memory_max_gib", "peak_memory_pct", "mfu", "mfu_dense"):
        assert all(isinstance(r[key], float) and r[key] > 0 for r in train), key
    assert all(r["mfu_dense"] > r["mfu"] and r["step_time_max_s"] >= r["step_time_s"] for r in train)
