"""A CP algorithm is one module and one registration: the all-gather under another name, defined and registered
here (outside the package), runs through ``train.py`` (``--set parallel.cp_algorithm=gather_again`` with this
module in ``train.imports``) with the very losses of the built-in all-gather; the registry resolves names and
aliases and says what it knows."""

from __future__ import annotations

import json

import pytest

from cp_train.parallel.cp.algorithms.allgather import AllGather
from cp_train.parallel.cp.algorithms.registry import (
    CPAlgorithm,
    cp_algorithm_names,
    get_cp_algorithm,
    register_cp_algorithm,
)
from tests import entry_points, trainer_cases


class GatherAgain(AllGather):
    """The all-gather, registered under another name: every behaviour comes from the algorithm object."""


register_cp_algorithm("gather_again", GatherAgain(), aliases=("again",))


def test_a_registered_algorithm_runs_through_train_py_as_the_one_it_copies(tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    names = ("allgather", "gather_again")
    configs = {name: entry_points.write_config(tmp_path / f"{name}.yaml", corpus, tmp_path / name, cp=2,
                                               **{"train.steps": 4, "parallel.cp_algorithm": name,
                                                  "train.imports": [__name__]}) for name in names}
    outcomes = entry_points.run_many({name: ["--config", str(configs[name])] for name in names}, world=2)
    losses = {}
    for name in names:
        assert outcomes[name].returncode == 0, outcomes[name].output[-3000:]
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        setup = next(r for r in records if r.get("kind") == "setup")
        assert setup["cp"] == 2, setup
        losses[name] = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses["allgather"]) == 4 and losses["gather_again"] == losses["allgather"]  # bitwise


def test_names_and_aliases_resolve_once_and_unknown_ones_list_the_choices() -> None:
    assert get_cp_algorithm("p2p") is get_cp_algorithm("ring") and get_cp_algorithm("a2a+p2p").subgroups
    assert get_cp_algorithm("again") is get_cp_algorithm("gather_again")
    algorithm = get_cp_algorithm("gather_again")
    assert isinstance(algorithm, CPAlgorithm) and get_cp_algorithm(algorithm) is algorithm
    assert cp_algorithm_names()[:4] == ["ring", "allgather", "ulysses", "hybrid"] and "gather_again" in \
        cp_algorithm_names()
    with pytest.raises(ValueError, match="unknown CP algorithm 'spiral'; choose one of ring, allgather.*train.imports"):
        get_cp_algorithm("spiral")
    with pytest.raises(TypeError, match="needs a CPAlgorithm"):
        register_cp_algorithm("nothing", object())  # type: ignore[arg-type]


def _compared_names(path) -> list[str]:  # noqa: ANN001 - a Path
    """``file:line`` of every comparison (``==``, ``!=``, ``in``, ``not in``) with an algorithm's name or a Megatron
    alias (but ``p2p`` and ``all_gather``, which also name communication kinds)."""
    import ast

    names = {*cp_algorithm_names(), "a2a", "a2a+p2p"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else
                                                    getattr(o, "elts", []))]
        if any(isinstance(c, ast.Constant) and c.value in names for c in constants):
            found.append(f"{path}:{node.lineno}")
    return found


def test_nothing_compares_algorithm_names_outside_the_algorithm_modules(tmp_path) -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [p for folder in ("cp_train", "model", "parallel", "data") for p in (root / folder).rglob("*.py")
             if "algorithms" not in p.parts]
    assert len(files) > 100
    assert [hit for path in files for hit in _compared_names(path)] == []
    probe = tmp_path / "probe.py"  # the scan sees a comparison
    probe.write_text('def f(a):\n    return a == "hybrid" or a in ("ring", "x")\n')
    assert _compared_names(probe) == [f"{probe}:2", f"{probe}:2"]
