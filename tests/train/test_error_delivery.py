"""A config error's one line arrives under load (``cp_train/errors.py``): 2 ranks through torchrun (which stops
every rank at the first exit) while a spinning process keeps the CPU busy, with rank 0 held back 3 s before it starts
(a ``sitecustomize`` on its ``PYTHONPATH``), so that rank 1 finds the error long before rank 0. Rank 1 must not exit
first (torchrun would stop rank 0 before it prints, as a fixed 2 s delay did): rank 0 prints the line once and
torchrun's summary names rank 0 as the root cause.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entry_points import REPO, Outcome, command, environment

HOLD_S = 3.0
MESSAGE = r"data\.seq_len 30 is not divisible by 2\*cp = 4 for the zigzag layout"
SLOW_RANK_0 = f"""import os, time
if os.environ.get("RANK") == "0":
    time.sleep({HOLD_S})
"""


@pytest.fixture()
def busy_cpu() -> Iterator[None]:
    """A process spinning for the length of the test: with the two ranks and torchrun's agent, more work than the
    test machine's two cores."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.parametrize("launcher", ["torchrun"])  # cp-train-launch's line: test_error_lines.py, test_errors.py
def test_a_config_error_line_arrives_when_rank_0_is_slow(tmp_path: Path, busy_cpu, launcher: str) -> None:
    (tmp_path / "sitecustomize.py").write_text(SLOW_RANK_0)
    env = environment()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    args = ["--config", str(REPO / "launch/configs/cpu-tiny.yaml"), "--seq-len", "30", "--run-dir", str(tmp_path)]
    done = subprocess.run(command(args, world=2, launcher=launcher), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    outcome = Outcome(done.returncode, done.stdout)
    lines = outcome.lines("train.py: ")
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and re.search(MESSAGE, lines[0]), \
        outcome.output[-3000:]
    assert "did not report it" not in outcome.output
    if launcher == "launch":
        assert outcome.returncode == 2, outcome.output[-3000:]
        assert outcome.lines("cp_train.cli.launch: ") == [
            "cp_train.cli.launch: train.py failed with exit code 2 (exit code 2 on rank 0; killed by SIGTERM on "
            "rank 1)"], outcome.output[-3000:]
        return
    summary = outcome.output[outcome.output.index("Root Cause"):]
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: 2 ", summary) and re.search(MESSAGE, summary), summary
