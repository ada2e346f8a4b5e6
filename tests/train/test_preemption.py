"""Preemption on a real 2-rank run (cp = 2, through ``cp_train.cli.launch``): SIGUSR1 to one rank saves a
checkpoint and stops the run with exit code 0; rerunning the same command resumes it with the uninterrupted run's
losses, bitwise, in the same wandb run. The records carry the max over ranks and both MFUs. The SIGUSR1 run saves
every step behind training (``--async-save``): the stop waits for the save in flight and for its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cp_train.checkpoint.dcp import LATEST
from tests import trainer_cases
from tests.entry_points import (
    REPO,
    command,
    environment,
    rank_pids,
    run,
    signal_rank,
    start,
    wait_for_step,
    write_config,
)

STEPS, SIGNAL_AT = 12, 2


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if r["kind"] == "train"}


def test_sigusr1_saves_and_exits_0_and_the_rerun_resumes_bitwise_in_the_same_wandb_run(tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", cp=2,
                          **{"train.steps": STEPS, "logging.wandb": True, "logging.wandb_mode": "offline"})
    args = ["--config", str(config), "--save", str(tmp_path / "ckpt"), "--async-save", "--save-interval", "1"]
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


SIGTERM_STEPS, LOG_EVERY = 12, 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("sigterm") / "docs")


@pytest.mark.parametrize("launcher", ["torchrun", "launch"])
def test_sigterm_to_every_process_saves_after_the_step_and_resumes_bitwise(corpus, tmp_path, launcher) -> None:
    """SIGTERM to every process of the run at once (as Slurm preempts: the launcher's process group and each rank,
    which torchrun starts in sessions of their own) after step 1: the ranks save after the step they are in, not at the
    next log step (6), and stop; the launcher waits for them and exits 0 with one line (plain torchrun's agent
    relays the signal and exits as it does); under torchrun the same command resumes with the
    uninterrupted losses, bitwise."""
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", cp=2,
                          **{"train.steps": SIGTERM_STEPS, "logging.interval": LOG_EVERY,
                             "train.imports": ["tests.slow_steps"]})
    args = ["--config", str(config), "--save", str(tmp_path / "ckpt")]
    slow = {**environment(), "SLOW_STEP_S": "0.3"}  # the signal lands a step or two after step 2, not at the log step
    with ThreadPoolExecutor(1) as pool:  # under torchrun, the uninterrupted run (its log records) beside it
        uninterrupted = pool.submit(run, ["--config", str(config), "--run-dir", str(tmp_path / "reference")],
                                    world=2, launcher="launch") if launcher == "torchrun" else None
        process = subprocess.Popen(command(args, 2, launcher), cwd=REPO, env=slow, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        wait_for_step(tmp_path / "run" / "metrics.jsonl", 0, process)  # the setup record, written after step 1
        ranks = rank_pids(process.pid)
        os.killpg(process.pid, signal.SIGTERM)
        for pid in ranks.values():
            os.kill(pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=300)
        done = uninterrupted.result() if uninterrupted is not None else None
    stopped = re.search(r"\[cp-train\] SIGTERM received: stopped at step (\d+) after saving a checkpoint; rerun the "
                        r"same command to resume", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert 1 <= step < LOG_EVERY and (tmp_path / "ckpt" / LATEST).read_text().strip() == f"step_{step:08d}"
    if launcher == "launch":  # the ranks' line is the last; plain torchrun's agent adds its own
        assert process.returncode == 0 and output.splitlines()[-1] == stopped.group(0), output[-3000:]
        return  # the resume is the same as under torchrun's
    assert done.returncode == 0, done.output[-3000:]  # the uninterrupted run (torchrun's case)
    reference = losses(tmp_path / "reference")  # at its log steps, every 6: each the interval's mean
    rerun = run(args, world=2, launcher=launcher)
    assert rerun.returncode == 0, rerun.output[-3000:]
    resumed = losses(tmp_path / "run")  # a record holds its interval's mean: compare the whole intervals after it
    assert resumed[step] and resumed[SIGTERM_STEPS] == reference[SIGTERM_STEPS]
