"""torch's AdamW kernels on CPU, fused against foreach: the optimizer step alone and the trainer's whole step.

    python -m bench.optimizer [--cases cp1 cp2-ring cp2-ring-fsdp] [--rounds 2] [--steps 6]

- ``adamw``: one AdamW step over cpu-tiny's 3.1M parameters (``build_optimizer``, random gradients), one thread;
  the median of repeated timings.
- each case (cpu-tiny with its overrides, one document per sample, spawned gloo ranks, glibc's defaults): the
  trainer's ``train_step`` with ``optimizer.implementation`` foreach and fused, a fresh world each, the two taking
  turns for ``--rounds`` rounds; a step is the slowest rank's, the figure the median of every round's steps after 3.

``ratio`` is fused / foreach, both measured in the same command. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/optimizer.py` from anywhere

from bench.common import emit, glibc_malloc  # noqa: E402
from cp_train.config.schema import Config  # noqa: E402
from cp_train.config.sources import load_config  # noqa: E402
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402

IMPLEMENTATIONS = ("foreach", "fused")
CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "cpu-tiny.yaml"
COMMON = {"data.document_mask": False, "train.valid_interval": 0, "train.steps": 1000, "logging.console": False,
          "logging.wandb": False, "logging.interval": 1000}
CASES: dict[str, dict[str, Any]] = {"cp1": {"parallel.cp": 1}, "cp2-ring": {}, "cp2-ring-fsdp": {"parallel.fsdp": True}}


def case_config(name: str, run_dir: str) -> Config:
    """cpu-tiny with the case's overrides, running into ``run_dir``."""
    values = {**COMMON, "logging.dir": f"{run_dir}/{name}", **CASES[name]}
    return load_config(CONFIG, overrides=[f"{key}={value}" for key, value in values.items()])


def adamw_seconds(implementation: str, repeats: int = 20) -> float:
    """One AdamW step over cpu-tiny's parameters with ``implementation``, one thread: the median of ``repeats``."""
    from cp_train.config.schema import OptimizerConfig
    from cp_train.model.gpt import GPTModel
    from cp_train.optim import build_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_config = case_config("cp1", "runs/bench-optimizer").model
        model_config.vocab_size = 8192  # the embedded corpus' tokenizer's
        model = GPTModel(model_config)
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer = build_optimizer(model, OptimizerConfig(implementation=implementation), torch.device("cpu"))
        optimizer.step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def step_seconds(state: ParallelState, name: str, implementation: str, steps: int) -> list[float]:
    """On every rank: ``steps`` timed ``train_step`` seconds of case ``name`` after 3, with ``implementation``."""
    from cp_train.trainer import Trainer

    config = case_config(name, "runs/bench-optimizer")
    config.optimizer.implementation = implementation
    trainer = Trainer(config, state)
    batches = iter(trainer.loader)
    seconds = []
    for _ in range(3 + steps):
        batch = next(batches)
        start = time.perf_counter()
        trainer.train_step(batch)
        seconds.append(time.perf_counter() - start)
    return seconds[3:]


def case_record(name: str, rounds: int, steps: int) -> dict[str, Any]:
    config = case_config(name, "runs/bench-optimizer")
    layout = (config.parallel.tp, config.parallel.cp, 1)
    size = config.parallel.tp * config.parallel.cp
    timed: dict[str, list[float]] = {implementation: [] for implementation in IMPLEMENTATIONS}
    for _ in range(rounds):
        for implementation in IMPLEMENTATIONS:
            with glibc_malloc(live_memory=False):
                world = SpawnedWorld(size, threads=max(1, 2 // size), timeout_s=1800)
            with world:
                runs = world.run(run_with_parallel, layout, step_seconds, name, implementation, steps)
            timed[implementation] += [max(r[i] for r in runs) for i in range(steps)]
    foreach, fused = (statistics.median(timed[i]) for i in IMPLEMENTATIONS)
    return {"case": name, "ranks": size, "foreach_s": foreach, "fused_s": fused, "ratio": fused / foreach}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.optimizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["cp1", "cp2-ring", "cp2-ring-fsdp"], choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    foreach, fused = (statistics.median([adamw_seconds(implementation) for _ in range(3)])
                      for implementation in IMPLEMENTATIONS)
    records = [{"case": "adamw", "ranks": 1, "foreach_s": foreach, "fused_s": fused, "ratio": fused / foreach}]
    records += [case_record(name, args.rounds, args.steps) for name in args.cases]
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    emit(records, [("case", "case", str), ("ranks", "ranks", str), ("foreach_s", "foreach ms", ms),
                   ("fused_s", "fused ms", ms), ("ratio", "fused / foreach", "{:.3f}".format)])
    return records


if __name__ == "__main__":
    main()
