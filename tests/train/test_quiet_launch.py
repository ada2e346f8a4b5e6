"""``cp-train-launch`` (``cp_train/cli/launch.py``): a console script with torchrun's flags, and Ctrl-C during a run
of 2 ranks (SIGINT to the launcher's process group, as a terminal sends it) ends with one line, exit code 130, no
traceback and no wandb summary (``MetricWriters.close`` finishes wandb quietly while an exception propagates)."""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from cp_train.cli import launch
from tests import trainer_cases
from tests.entry_points import REPO, command, environment, wait_for_step, write_config


def test_the_console_script_is_the_launcher_with_torchruns_flags(capsys) -> None:
    entry = re.search(r'^cp-train-launch = "([\w.]+):(\w+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert entry, "pyproject.toml [project.scripts] names cp-train-launch"
    module, name = entry.groups()
    assert getattr(importlib.import_module(module), name) is launch.console_main
    with pytest.raises(SystemExit) as stop:
        launch.main(["--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0 and all(flag in text for flag in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint"))


@pytest.mark.parametrize(("argv", "words"), [
    (["--nproc-per-node", "0", "train.py"], "--nproc-per-node 0: pass the number of processes per node (1 or more)"),
    (["--nproc-per-node", "abc", "train.py"], "or gpu, cpu, xpu or auto"),
    (["--nproc-per-node", "2", "--bogus-flag", "1", "train.py"], "unrecognized arguments: --bogus-flag: torchrun's"),
    (["--nprocs-per-node", "2", "train.py"], "did you mean --nproc-per-node?"),
    (["--max-restarts", "x", "train.py"], "argument --max-restarts/--max_restarts: invalid int value: 'x'"),
])
def test_bad_launcher_flags_are_one_line(capsys, argv: list[str], words: str) -> None:
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{launch.PROG}: error: ") and len(err.splitlines()) == 1 and words in err, err


def test_ctrl_c_prints_one_line(tmp_path: Path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", corpus, run_dir, cp=2, **{
        "train.steps": 500, "logging.wandb": True, "logging.wandb_mode": "offline"})
    process = subprocess.Popen(command(["--config", str(config)], world=2, launcher="launch"), cwd=REPO,
                               env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 2, process, timeout=180)
        os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: the launcher's group (the ranks have their own)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = output.splitlines()
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    assert process.returncode == 0, output[-3000:]  # saved (had checkpoint.save been set) and stopped
    stop, = lines[last_step + 1:]
    assert re.fullmatch(r"\[cp-train\] SIGINT received: stopped at step \d+ without a checkpoint \(checkpoint.save "
                        r"is not set: set --save DIR to make a stop resumable\)", stop), output[-3000:]
    assert "Traceback" not in output and "Run summary" not in output and "wandb sync" not in output, output[-3000:]
