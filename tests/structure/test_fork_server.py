"""``tests/fork_server.py`` runs a script as a fresh interpreter would: the same output and exit code for every way
a script ends, and a forked training run trains bitwise like a fresh ``python train.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import trainer_cases
from tests.entry_points import environment, fork_server, run, write_config

ENDINGS = {  # name -> (script, the exit code)
    "returns": ("print('done')\n", 0),
    "exit code": ("import sys\nprint('out'); print('err', file=sys.stderr)\nsys.exit(3)\n", 3),
    "exit message": ("import sys\nsys.exit('stopped: a message')\n", 1),
    "uncaught": ("def fail():\n    raise ValueError('broken')\nfail()\n", 1),
    "killed": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", -9),
    "atexit": ("import atexit\natexit.register(lambda: print('at exit'))\n", 0),
    "argv, cwd, environment": ("import os, sys\nprint(sys.argv[1:], os.path.basename(os.getcwd()), "
                               "os.environ.get('RANK'), os.environ['OMP_NUM_THREADS'])\n", 0),
}


def _fresh(script: Path, args: list[str], cwd: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    return done.returncode, done.stdout


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_script_ends_as_a_fresh_interpreter_does(tmp_path, ending) -> None:
    script = tmp_path / "script.py"
    text, expected = ENDINGS[ending]
    script.write_text(text)
    (tmp_path / "here").mkdir()
    forked = fork_server().run(str(script), ["a", "b"], tmp_path / "here", timeout=60)
    code, output = _fresh(script, ["a", "b"], tmp_path / "here")
    assert (forked.returncode, forked.output) == (code, output) and code == expected


def test_a_forked_run_trains_bitwise_like_python_train_py(tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    losses = {}
    for fork in (True, False):
        config = write_config(tmp_path / f"run-{fork}.yaml", corpus, tmp_path / f"run-{fork}", **{"train.steps": 4})
        outcome = run(["--config", str(config)], fork=fork)
        assert outcome.returncode == 0, outcome.output[-3000:]
        records = (tmp_path / f"run-{fork}" / "metrics.jsonl").read_text().splitlines()
        losses[fork] = [r["loss"] for r in map(json.loads, records) if r["kind"] == "train"]
    assert len(losses[True]) == 4 and losses[True] == losses[False]
