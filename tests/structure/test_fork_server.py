"""``tests/fork_server.py`` runs a script as a fresh interpreter would: the same output and exit code for every way
a script ends, and a forked training run trains bitwise like a fresh ``python train.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import trainer_cases
from tests.entry_points import REPO, environment, fork_server, run, write_config

ENDINGS = {
    "returns": "print('done')\n",
    "exit code": "import sys\nprint('out'); print('err', file=sys.stderr)\nsys.exit(3)\n",
    "exit message": "import sys\nsys.exit('stopped: a message')\n",
    "uncaught": "def fail():\n    raise ValueError('broken')\nfail()\n",
    "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "atexit": "import atexit\natexit.register(lambda: print('at exit'))\n",
    "argv and cwd": "import os, sys\nprint(sys.argv[1:], os.path.basename(os.getcwd()), os.environ.get('RANK'))\n",
}


def _fresh(script: Path, args: list[str], cwd: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    return done.returncode, done.stdout


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_script_ends_as_a_fresh_interpreter_does(tmp_path, ending) -> None:
    script = tmp_path / "script.py"
    script.write_text(ENDINGS[ending])
    (tmp_path / "here").mkdir()
    forked = fork_server().run(str(script), ["a", "b"], tmp_path / "here", timeout=60)
    code, output = _fresh(script, ["a", "b"], tmp_path / "here")
    assert (forked.returncode, forked.output) == (code, output)
    assert code == {"returns": 0, "exit code": 3, "killed": -9}.get(ending, 1 if ending in (
        "exit message", "uncaught") else 0)


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
    assert REPO.is_dir()
