"""Running ``train.py`` as a user does, for the failure tests: ``python train.py`` (a world of one),
``torchrun`` (``python -m torch.distributed.run``) or ``python -m cp_train.cli.launch`` with 2 ranks.

``run`` forks a world of one from ``tests/fork_server.py``, which has torch and the project imported already (the
same script, arguments, directory, environment and exit code; ``CP_TRAIN_TEST_FORK=0`` starts a fresh interpreter
instead); ``start`` and every launcher start fresh processes. Runs use the tiny model of ``trainer_cases`` on its
synthetic corpus, written as a YAML config.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cp_train.config.schema import dump_yaml
from cp_train.parallel.mesh.rank_groups import ParallelDims
from cp_train.parallel.spawn import free_port
from tests import trainer_cases

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")
PROJECT_FRAME = re.compile(r'File "[^"]*(cp_train|model|parallel|data)/[^"]*\.py"|File "[^"]*train\.py"')


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a run: no wandb, torchelastic, rank or debug variables; ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TORCHELASTIC_", "CP_TRAIN_DEBUG"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})})
    return env


def write_config(path: Path, corpus: str, run_dir: Path, cp: int = 1, **overrides: Any) -> Path:
    """The tiny run (tp 1, ``cp``, dp from the world) as a YAML file; ``overrides`` are dotted keys."""
    values = {"train.valid_interval": 0, "logging.console": True, "logging.interval": 1, "parallel.dp": None,
              **overrides}
    path.write_text(dump_yaml(trainer_cases.tiny_config(corpus, str(run_dir), ParallelDims(cp=cp), **values)))
    return path


def command(args: Sequence[str], world: int = 1, launcher: str = "torchrun") -> list[str]:
    """``python train.py ARGS`` for a world of one, else 2+ ranks through ``torchrun`` or ``cp_train.cli.launch``."""
    if world == 1:
        return [sys.executable, TRAIN, *args]
    module = "torch.distributed.run" if launcher == "torchrun" else "cp_train.cli.launch"
    return [sys.executable, "-m", module, "--nproc-per-node", str(world), "--master-port", str(free_port()),
            TRAIN, *args]


@dataclass
class Outcome:
    returncode: int
    output: str  # stdout and stderr together

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


class ForkServer:
    """The client of one ``tests/fork_server.py`` process, started on first use and ended with the tests."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.fork_server"], cwd=REPO, env=environment(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()
        self.outputs = tempfile.TemporaryDirectory(prefix="cp-train-forked-")
        self.count = 0

    def run(self, script: str, args: Sequence[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
            ) -> Outcome:
        """``python script ARGS`` in ``cwd`` with ``environment(env)``, forked; TimeoutExpired after ``timeout`` s."""
        with self.lock:
            self.count += 1
            output = Path(self.outputs.name) / f"run-{self.count}.log"
            request = {"script": script, "args": list(args), "cwd": str(cwd), "env": environment(env),
                       "output": str(output)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server ended (exit code {self.process.wait()})")
        group = json.loads(reply)["pid"]
        code_file, deadline = Path(f"{output}.rc"), time.monotonic() + timeout
        while not code_file.exists():
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):  # it ended in the meantime
                    os.killpg(group, signal.SIGKILL)
                raise subprocess.TimeoutExpired([script, *args], timeout)
            time.sleep(0.02)
        return Outcome(int(code_file.read_text()), output.read_text(errors="replace"))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.outputs.cleanup()


_FORK_SERVER: list[ForkServer] = []  # the one server, once started
_FORK_SERVER_LOCK = threading.Lock()


def fork_server() -> ForkServer:
    with _FORK_SERVER_LOCK:
        if not _FORK_SERVER:
            _FORK_SERVER.append(ForkServer())
            atexit.register(_FORK_SERVER[0].close)
        return _FORK_SERVER[0]


def run(args: Sequence[str], world: int = 1, launcher: str = "torchrun", cwd: Path | None = None,
        timeout: float = 300, wrap: Sequence[str] = (), fork: bool | None = None,
        env: dict[str, str] | None = None) -> Outcome:
    """``train.py ARGS`` run to its end (``command``), with ``env`` added to ``environment()``. A world of one
    without ``wrap`` is forked from the fork server unless ``fork`` is False (default: unless
    ``CP_TRAIN_TEST_FORK=0``)."""
    if fork is None:
        fork = os.environ.get("CP_TRAIN_TEST_FORK", "1") != "0"
    if fork and world == 1 and not wrap:
        return fork_server().run(TRAIN, args, cwd or REPO, timeout, env)
    done = subprocess.run([*wrap, *command(args, world, launcher)], cwd=cwd or REPO, env=environment(env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return Outcome(done.returncode, done.stdout)


def run_many(cases: dict[str, list[str]], **kwargs: Any) -> dict[str, Outcome]:
    """Several ``run``s, two at a time (each is mostly a Python + torch start-up)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, args, **kwargs) for name, args in cases.items()}
        return {name: future.result() for name, future in futures.items()}


def assert_one_line(outcome: Outcome, code: int, pattern: str, prog: str = "train.py") -> str:
    """``outcome`` exited with ``code`` after printing one ``prog: error|failed:`` line matching ``pattern``,
    and no traceback at all; returns that line."""
    kind = "error" if code == 2 else "failed"
    lines = outcome.lines(f"{prog}: ")
    assert outcome.returncode == code, outcome.output[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: {kind}: "), outcome.output[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    return lines[0]


def rank_pids(launcher_pid: int, timeout: float = 60) -> dict[int, int]:
    """``{rank: pid}`` of the workers a torchrun process started (read from /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids: dict[int, int] = {}
        for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                try:
                    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                ranks = [e[5:] for e in environ if e.startswith(b"RANK=")]
                if ranks:
                    pids[int(ranks[0])] = child
        if pids:
            return pids
        time.sleep(0.1)
    raise TimeoutError(f"no workers of process {launcher_pid} found")


def wait_for_step(metrics: Path, step: int, process: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until ``metrics`` (a metrics.jsonl) holds a record of ``step`` or later."""
    deadline = time.monotonic() + timeout
    pattern = re.compile(r'"step": (\d+)')
    while time.monotonic() < deadline:
        if metrics.is_file() and any(int(m) >= step for m in pattern.findall(metrics.read_text())):
            return
        if process.poll() is not None:
            raise AssertionError(f"the run ended before step {step}:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached within {timeout} s")


def start(args: Sequence[str], world: int, launcher: str = "torchrun") -> subprocess.Popen:
    return subprocess.Popen(command(args, world, launcher), cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def signal_rank(process: subprocess.Popen, rank: int, signum: signal.Signals) -> int:
    pid = rank_pids(process.pid)[rank]
    os.kill(pid, signum)
    return pid
