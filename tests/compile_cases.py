"""Rank side of test_compile.py: the tiny trainer run eager, then with ``train.compile``, on one layout.

Called as ``run_with_parallel((tp, cp, dp), train_eager_and_compiled, ...)`` on every rank of a spawned gloo
world. Dynamo's state is reset before each run, so its counters count that run's graphs and graph breaks.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from cp_train.metrics.writers import METRICS_FILE
from cp_train.parallel.mesh.state import ParallelState
from cp_train.trainer import Trainer
from tests.trainer_cases import tiny_config


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def compiled_with(backend: str) -> Iterator[None]:
    """``torch.compile`` calls (the model's ``compile_parts``) use ``backend`` inside the block: ``inductor`` as
    they do, or ``aot_eager_decomp_partition`` (Dynamo, AOTAutograd with Inductor's decompositions and its
    partitioner, then the graphs run as ATen ops: everything Inductor does before its code generation)."""
    if backend == "inductor":
        yield
        return
    original = torch.compile
    torch.compile = functools.partial(original, backend=backend)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def train_eager_and_compiled(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any],
                             backend: str = "inductor") -> dict[str, Any]:
    """Per mode ("eager", "compiled"): the step losses and gradient norms, Dynamo's graph count after each
    step, its graph breaks (reason -> count) and what the setup record says was compiled; ``backend``: the
    compiled run's (``compiled_with``)."""
    out: dict[str, Any] = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        settings = {**overrides, "train.compile": mode == "compiled", "train.valid_interval": 0}
        with compiled_with(backend):  # the model compiles its parts as the trainer builds it
            trainer = Trainer(tiny_config(prefix, f"{run_dir}/{mode}", state.dims, **settings), state)
            graphs: list[int] = []
            trainer.grad_callback = lambda step, graphs=graphs: graphs.append(_graphs())
            result = trainer.train()
        records = [json.loads(line) for line in (Path(run_dir) / mode / METRICS_FILE).read_text().splitlines()]
        out[mode] = {"losses": result.losses, "grad_norms": result.grad_norms, "graphs": graphs,
                     "breaks": dict(counters["graph_break"]),
                     "compiled": [r["compiled"] for r in records if r.get("kind") == "setup"]}
    torch._dynamo.reset()
    return out
