"""What the test suite pays per job and per process: the strict communication layer on a training job, a
spawned world's start, a command's start and end and the compilation of the project's source.

    python -m bench.suite_costs [--rounds 3] [--layout 1,4,1] [--steps 12] [--world 8] [--only end ...]

``job``: the suite's tiny fp32 training run (``tests/trainer_cases.train_layout``: 12 steps, documents, two
evaluations) at (tp, cp, dp) ``--layout`` in three spawned gloo worlds kept alive side by side: ``plain`` (no
layer), ``strict`` (``tests/strict_comm.py`` as the suite's shared worlds run it: NCCL's pairing by order and the
after-job check) and ``declare`` (the same with ``CP_TRAIN_STRICT_DECLARE=1``: a store round trip per message and
per collective). The worlds take turns round by round, so drift on a shared machine hits each alike; one warm-up
job each first. ``start``: ``python train.py`` stopped by an input error (a missing data prefix: the config parsed
and checked, nothing built) against ``python -c "import torch"``, alternating. ``world``: a ``SpawnedWorld`` of
``--world`` ranks under the strict layer started, its first job run (importing the trainer's test cases and
building an optimizer, as every training job does: torch's first one imports Dynamo) and closed, spawned (a fresh
interpreter per rank) against forked from a server that preloaded the trainer, and one that preloaded Dynamo and
Inductor too (the suite's ``tests/conftest.py``; each case in a process of its own, whose server's start is a
warm-up world not counted), alternating. ``end``: a 2-rank run through ``cp_train.cli.launch`` whose launcher and
ranks end through the interpreter's teardown of their modules, against the commands' ``exit_now``, alternating.
``compile``: compiling the source of the project's modules that
``train.py`` and the trainer import, what every fresh interpreter pays where ``PYTHONDONTWRITEBYTECODE`` keeps it
from caching the bytecode (the suite byte-compiles the project first). Prints JSON lines, then a table (medians;
``vs`` is the ratio to the first row of its kind).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/suite_costs.py` from anywhere

from bench.common import emit  # noqa: E402
from cp_train.config.schema import dump_yaml  # noqa: E402
from cp_train.parallel.mesh.state import ParallelDims, ParallelState, run_with_parallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402
from tests import trainer_cases  # noqa: E402
from tests.strict_comm import DECLARE  # noqa: E402

WORLDS = {"plain": {}, "strict": {"layer": "tests.strict_comm"},
          "declare": {"layer": "tests.strict_comm", "env": {DECLARE: "1"}}}


def timed_job(state: ParallelState, corpus: str, run_dir: str, steps: int) -> float:
    start = time.perf_counter()
    trainer_cases.train_layout(state, corpus, run_dir, {"train.steps": steps})
    return time.perf_counter() - start


def jobs(layout: tuple[int, int, int], rounds: int, steps: int, root: Path) -> list[dict]:
    corpus = trainer_cases.write_corpus(root / "docs")
    world_size = layout[0] * layout[1] * layout[2]
    worlds = {name: SpawnedWorld(world_size, **kwargs) for name, kwargs in WORLDS.items()}
    times: dict[str, list[float]] = {name: [] for name in worlds}
    try:
        for round_ in range(rounds + 1):  # round 0 warms each world up
            for name, world in worlds.items():
                seconds = max(world.run(run_with_parallel, layout, timed_job, corpus,
                                        str(root / f"{name}-{round_}"), steps))
                if round_:
                    times[name].append(seconds)
    finally:
        for world in worlds.values():
            world.close()
    base = statistics.median(times["plain"])
    return [{"kind": "job", "case": name, "layout": "x".join(map(str, layout)), "seconds": statistics.median(t),
             "vs": statistics.median(t) / base, "runs": t} for name, t in times.items()]


def first_job() -> bool:
    import torch

    import tests.trainer_cases  # noqa: F401 - what a world's first training job imports

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # and what its optimizer imports (Dynamo)
    return True


def world_seconds(size: int, preload: Sequence[str]) -> float:
    """Seconds to start a world of ``size`` ranks under the strict layer, run its first job and close it; with
    ``preload``, forked from a server that imported those modules, after a warm-up world that starts the server
    (its one list holds for the rest of the process: run one case per process)."""
    for _ in range(2 if preload else 1):
        start = time.perf_counter()
        with SpawnedWorld(size, layer="tests.strict_comm", preload=preload) as world:
            world.run(first_job)
    return time.perf_counter() - start


def world_starts(size: int, rounds: int) -> list[dict]:
    trainer = ("tests.strict_comm", "cp_train.trainer", "tests.trainer_cases")
    compilers = ("torch._dynamo", "torch._inductor.compile_fx")
    preloads = {"spawn": (), "forkserver preload": trainer,
                "forkserver preload, Dynamo and Inductor too": (*trainer, *compilers)}
    times: dict[str, list[float]] = {name: [] for name in preloads}
    for _ in range(rounds):
        for name, preload in preloads.items():
            code = f"from bench.suite_costs import world_seconds; print(world_seconds({size}, {preload!r}))"
            done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
            times[name].append(float(done.stdout.split()[-1]))
    base = statistics.median(times["spawn"])
    return [{"kind": "world", "case": f"{name}, {size} ranks", "seconds": statistics.median(t),
             "vs": statistics.median(t) / base, "runs": t} for name, t in times.items()]


def starts(rounds: int, root: Path) -> list[dict]:
    config = root / "start.yaml"
    config.write_text(dump_yaml(trainer_cases.tiny_config(str(root / "missing"), str(root / "start"),
                                                          ParallelDims())))
    commands = {"import torch": [sys.executable, "-c", "import torch"],
                "train.py, input error": [sys.executable, str(ROOT / "train.py"), "--config", str(config)],
                "train.py --help": [sys.executable, str(ROOT / "train.py"), "--help"],
                "train.py, a misspelt flag": [sys.executable, str(ROOT / "train.py"), "--config", str(config),
                                              "--cp-sise", "2"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, cwd=ROOT, capture_output=True, check=name == "import torch")
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["import torch"])
    return [{"kind": "start", "case": name, "seconds": statistics.median(t), "vs": statistics.median(t) / base,
             "runs": t} for name, t in times.items()]


def ends(rounds: int, root: Path) -> list[dict]:
    """A 2-rank run of the tiny job (12 steps at cp 2) through ``python -m cp_train.cli.launch``: the launcher and
    ``train.py`` ending through the interpreter's teardown (``sys.exit(main())``, as before ``exit_now``) against
    the commands as they end now (``cp_train.errors.exit_now``), alternating."""
    corpus = trainer_cases.write_corpus(root / "end-docs")
    config = root / "end.yaml"
    config.write_text(dump_yaml(trainer_cases.tiny_config(corpus, str(root / "end"), ParallelDims(cp=2), **{
        "train.steps": 12, "train.valid_interval": 0, "parallel.dp": None})))
    old_train = root / "train_sys_exit.py"
    old_train.write_text("import sys\nfrom cp_train.cli.train import main\nsys.exit(main())\n")
    old_launch = [sys.executable, "-c", "import sys; from cp_train.cli.launch import main; sys.exit(main())"]
    commands = {"sys.exit (the interpreter's teardown)": [*old_launch, "--nproc-per-node", "2", str(old_train)],
                "exit_now (the commands now)": [sys.executable, "-m", "cp_train.cli.launch", "--nproc-per-node", "2",
                                                str(ROOT / "train.py")]}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for round_index in range(rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run([*command, "--config", str(config), "--run-dir", str(root / f"end-{round_index}")],
                           cwd=ROOT, env=env, capture_output=True, check=True)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(next(iter(times.values())))
    return [{"kind": "end", "case": f"2-rank launch, 12 steps, {name}", "seconds": statistics.median(t),
             "vs": statistics.median(t) / base, "runs": t} for name, t in times.items()]


def compile_costs(rounds: int) -> list[dict]:
    """Compiling, as a fresh interpreter without cached bytecode does, the source of every project module that
    ``train.py`` and the trainer import (this process imported them: ``cp_train.cli.train``, ``cp_train.trainer``)."""
    import cp_train.cli.train  # noqa: F401
    import cp_train.trainer  # noqa: F401

    packages = [ROOT / folder for folder in ("cp_train", "model", "parallel", "data")]  # not bench/ or tests/
    files = sorted({Path(module.__file__) for module in list(sys.modules.values()) if getattr(module, "__file__", None)
                    and any(Path(module.__file__).is_relative_to(package) for package in packages)})
    sources = [(str(path), path.read_text()) for path in files]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for name, source in sources:
            compile(source, name, "exec")
        times.append(time.perf_counter() - start)
    return [{"kind": "compile", "case": f"the {len(files)} project modules a run imports", "seconds":
             statistics.median(times), "vs": 1.0, "runs": times}]


KINDS = ["job", "world", "start", "end", "compile"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", default="1,4,1", help="tp,cp,dp of the training job")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--world", type=int, default=8, help="ranks of the world whose start is timed")
    parser.add_argument("--only", nargs="+", choices=KINDS, default=KINDS, help="the kinds to time (default: all)")
    args = parser.parse_args()
    layout = tuple(int(part) for part in args.layout.split(","))
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"job": lambda: jobs(layout, args.rounds, args.steps, Path(tmp)),
                 "world": lambda: world_starts(args.world, args.rounds),
                 "start": lambda: starts(2 * args.rounds, Path(tmp)), "end": lambda: ends(args.rounds, Path(tmp)),
                 "compile": lambda: compile_costs(args.rounds)}
        for kind in args.only:
            records += parts[kind]()
    emit(records, [("kind", "kind", str), ("case", "case", str), ("seconds", "median s", lambda v: f"{v:.2f}"),
                   ("vs", "vs", lambda v: f"{v:.2f}")])


if __name__ == "__main__":
    main()
