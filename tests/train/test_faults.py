"""Faults injected into real 2-rank runs (cp = 2): a rank killed with SIGKILL mid-run, a rank that hangs
(SIGSTOP) until its peer's collective times out, and a disk that fills up during a save.

The killed run is rerun with the same command: it resumes from the last complete checkpoint, its losses equal
the uninterrupted run's bitwise, and its metrics.jsonl holds one record per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cp_train.checkpoint.dcp import LATEST, step_dir_name
from tests import trainer_cases
from tests.entry_points import (
    PROJECT_FRAME,
    assert_one_line,
    rank_pids,
    run,
    signal_rank,
    start,
    wait_for_step,
    write_config,
)

STEPS, INTERVAL, KILL_AT = 12, 2, 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len({r["step"] for r in train}) == len(train), f"steps logged twice: {[r['step'] for r in train]}"
    return {r["step"]: r["loss"] for r in train}


def test_killed_rank_then_the_same_command_resumes_bitwise(corpus, tmp_path) -> None:
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", cp=2, **{"train.steps": STEPS})
    args = ["--config", str(config), "--save", str(tmp_path / "ckpt"), "--save-interval", str(INTERVAL)]
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run beside the killed one
        uninterrupted = pool.submit(run, ["--config", str(config), "--run-dir", str(tmp_path / "reference")],
                                    world=2, launcher="launch")
        process = start(args, world=2, launcher="launch")
        wait_for_step(tmp_path / "run" / "metrics.jsonl", KILL_AT, process)
        signal_rank(process, 1, signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
        reference = uninterrupted.result()
    assert reference.returncode == 0, reference.output[-3000:]
    assert process.returncode != 0 and "killed by SIGKILL on rank 1" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    latest = (tmp_path / "ckpt" / LATEST).read_text().strip()
    resumed_at = int(latest.removeprefix("step_"))
    assert resumed_at >= INTERVAL and resumed_at % INTERVAL == 0, latest

    rerun = run(args, world=2, launcher="launch")
    assert rerun.returncode == 0, rerun.output[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / latest} at step {resumed_at}" in rerun.output
    expected = losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses(tmp_path / "run") == expected, "the resumed curve is not bitwise the uninterrupted one"
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == step_dir_name(STEPS)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _seconds_until(done, timeout: float) -> float:  # noqa: ANN001 - a predicate
    """Poll ``done()`` until it holds or ``timeout`` seconds pass; the seconds waited."""
    start = time.monotonic()
    while not done() and time.monotonic() - start < timeout:
        time.sleep(0.05)
    return time.monotonic() - start


@contextlib.contextmanager
def _endless_run(corpus: str, tmp_path: Path, launcher: str, step: int, **overrides: object
                 ) -> Iterator[tuple[subprocess.Popen, dict[int, int]]]:
    """A 2-rank run without end, started and at ``step``: (the launcher process, {rank: pid}); ranks still
    alive afterwards are killed (a stopped process ignores torchrun's SIGTERM)."""
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", cp=2,
                          **{"train.steps": 100_000, "logging.console": False, **overrides})
    process = start(["--config", str(config)], world=2, launcher=launcher)
    pids: dict[int, int] = {}
    try:
        wait_for_step(tmp_path / "run" / "metrics.jsonl", step, process)
        pids.update(rank_pids(process.pid))
        yield process, pids
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            process.kill()


def _hung_rank(corpus: str, tmp_path: Path) -> tuple[float, str]:
    """Rank 1 stops (SIGSTOP) at step 3 of a plain-torchrun run with parallel.timeout_minutes = 0.05 (3 s): the
    seconds until rank 0 ended, and the run's output."""
    with _endless_run(corpus, tmp_path, "torchrun", 3, **{"parallel.timeout_minutes": 0.05}) as (process, pids):
        os.kill(pids[1], signal.SIGSTOP)
        waited = _seconds_until(lambda: not _alive(pids[0]), 120)
    output, _ = process.communicate(timeout=120)
    return waited, output


def _killed_launcher(corpus: str, tmp_path: Path) -> list[int]:
    """SIGKILL to the launcher of a run at step 2: the pids of its ranks still alive a while after."""
    with _endless_run(corpus, tmp_path, "launch", 2) as (process, pids):
        process.kill()
        process.communicate(timeout=60)
        _seconds_until(lambda: not any(_alive(pid) for pid in pids.values()), 60)
        return [pid for pid in pids.values() if _alive(pid)]


@pytest.fixture(scope="module")
def stalled_runs(corpus, tmp_path_factory) -> dict:
    """The hung-rank and killed-launcher runs side by side (each mostly waits: a timeout, a poll)."""
    with ThreadPoolExecutor(2) as pool:
        hung = pool.submit(_hung_rank, corpus, tmp_path_factory.mktemp("hung"))
        killed = pool.submit(_killed_launcher, corpus, tmp_path_factory.mktemp("launcher-killed"))
        return {"hung": hung.result(), "survivors": killed.result()}


def test_hung_rank_times_out_naming_the_collective_and_the_key(stalled_runs) -> None:
    """Rank 1 stops (SIGSTOP) mid-run; rank 0's collective times out after parallel.timeout_minutes = 0.05
    (3 s). Through plain torchrun: rank 0's one line, its exit code 1 in torchrun's summary, no project traceback."""
    waited, output = stalled_runs["hung"]
    assert 2.5 < waited < 60, f"rank 0 stopped {waited:.1f} s after rank 1 hung"
    lines = [line for line in output.splitlines() if line.startswith("train.py: ")]
    assert len(lines) == 1, output[-3000:]
    assert re.fullmatch(r"train\.py: failed: rank 0: \w+ on the (cp|dp_cp|tp_cp|world) group \(ranks 0, 1.*\) timed "
                        r"out after 0\.05 min \(parallel\.timeout_minutes=0\.05\): another rank of the group stopped "
                        r"taking part .*raise parallel\.timeout_minutes.*", lines[0]), lines[0]
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: 1 ", output), output[-3000:]
    assert not PROJECT_FRAME.search(output), output[-3000:]


def test_ranks_stop_when_their_launcher_is_killed(stalled_runs) -> None:
    """torchrun starts ranks in sessions of their own; SIGKILL to the launcher must not leave them training on."""
    assert stalled_runs["survivors"] == [], "the ranks outlived their launcher"


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs a mount namespace (unshare -rm) for a small tmpfs")
def test_full_disk_during_a_save_says_no_space_left(corpus, tmp_path) -> None:
    """The checkpoint directory is a 700 KiB tmpfs: the save at step 2 fits, the one at step 4 does not."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run", cp=2,
                          **{"train.steps": 6, "logging.console": False})
    in_namespace = ['sh', '-c', 'mount -t tmpfs -o size=700k tmpfs "$0" && "$@"; code=$?; '
                    'echo "latest: $(cat "$0/latest")"; exit $code', str(ckpt)]
    outcome = run(["--config", str(config), "--save", str(ckpt), "--save-interval", "2"], world=2,
                  launcher="launch", wrap=["unshare", "-rm", *in_namespace])
    assert_one_line(outcome, 1, rf"no space left on device while saving checkpoint {ckpt}/step_00000004 \(\d+\.\d "
                                rf"MiB free in {ckpt}\): free space there, point --save \(checkpoint\.save\) elsewhere "
                                rf"or lower checkpoint\.keep; {ckpt}/latest still names step_00000002$")
    assert "latest: step_00000002" in outcome.output
