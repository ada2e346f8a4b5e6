"""``cp_train.errors.exit_now``: the commands' end keeps what the interpreter's exit does for the world
outside (threads finished, executors' jobs done, ``atexit`` handlers, buffered output, the exit code) and skips
the teardown of the modules' objects (a module-level object's ``__del__`` does not run); the same when the fork
server runs the script. ``train.py``, ``python -m cp_train``, ``python -m cp_train.eval``, ``python -m
cp_train.plan`` and every console script end through it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.entry_points import REPO, environment, fork_server

SCRIPT = """\
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from cp_train.errors import exit_now

class Module:
    def __del__(self):
        print("module teardown")

kept = Module()
atexit.register(lambda: print("at exit"))
printed = threading.Event()
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"), printed.set())).start()
ThreadPoolExecutor(1).submit(lambda: (printed.wait(), print("job done")))
sys.stdout.write("buffered, ")
{end}
"""


@pytest.mark.parametrize("end", ["exit_now(3)", "sys.exit(3)"])
def test_exit_now_keeps_the_exit_and_skips_the_teardown(tmp_path, end: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(end=end))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout.startswith("buffered, "), done.stdout
    teardown = [] if end.startswith("exit_now") else ["module teardown"]
    assert done.stdout.splitlines() == ["buffered, thread done", "job done", "at exit", *teardown], done.stdout
    forked = fork_server().run(str(script), [], tmp_path, timeout=60)  # which never tears the modules down
    assert forked.returncode == 3 and forked.output == done.stdout.removesuffix("module teardown\n"), forked.output


@pytest.mark.parametrize("path", ["train.py", "cp_train/__main__.py", "cp_train/cli/train.py",
                                  "cp_train/eval/__main__.py", "cp_train/cli/launch.py", "cp_train/plan/__main__.py"])
def test_the_commands_end_through_it(path: str) -> None:
    text = (REPO / path).read_text()
    assert ("exit_now(" in text or "console_main()" in text) and not re.search(r"sys\.exit\(main", text), path


def test_every_console_script_ends_through_it() -> None:
    """Each ``[project.scripts]`` entry is its module's ``console_main``, which ends with ``exit_now``."""
    import importlib
    import inspect

    section = (REPO / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M))
    assert len(scripts) >= 7, scripts
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert function == "console_main", (name, target)
        source = inspect.getsource(getattr(importlib.import_module(module), function))
        assert "exit_now(" in source, (name, source)
