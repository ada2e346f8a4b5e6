"""The public faces: every name in every package's ``__all__`` imports (lazily, from its defining module), and
the commands run from any directory once the package is installed (``pip install -e .``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FACES = ("cp_train", "cp_train.parallel", "cp_train.model", "cp_train.data")
CONFIG = ROOT / "launch" / "configs" / "cpu-tiny.yaml"


def _packages() -> list[str]:
    from tests.structure.test_layering import MODULES

    return sorted(name for name, path in MODULES.items() if path.name == "__init__.py")


@pytest.mark.parametrize("package", _packages())
def test_every_name_in_all_imports(package: str) -> None:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", [])
    assert names == sorted(set(names)), "__all__ is sorted, without repeats"
    for name in names:
        value = getattr(module, name)
        assert value is not None, name
        exec(f"from {package} import {name}", {})  # noqa: S102 - the import form users write
    assert set(names) <= set(dir(module))


@pytest.mark.parametrize("package", FACES)
def test_each_face_lists_an_api_and_names_what_it_lacks(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__, f"{package} lists no public API"
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_public_names_are_the_defining_objects() -> None:
    from cp_train.parallel import ModelParallel, context_parallel_attention, zigzag_ring_flash_attn_func
    from cp_train.parallel.cp.attention import context_parallel_attention as defined
    from cp_train.parallel.cp.dropins import zigzag_ring_flash_attn_func as dropin
    from cp_train.parallel.mesh.model_parallel import ModelParallel as settings

    assert (context_parallel_attention, zigzag_ring_flash_attn_func, ModelParallel) == (defined, dropin, settings)


TRAINING_COMMANDS = [[sys.executable, str(ROOT / "train.py")], ["cp-train"],
                     [sys.executable, "-m", "cp_train.cli.train"]]
HELP_COMMANDS = [
    (["cp-train-preprocess"], "cp-train-preprocess"),
    (["cp-train-export-hf"], "cp-train-export-hf"),
    ([sys.executable, "-m", "cp_train.cli.preprocess"], "cp-train-preprocess"),
    ([sys.executable, "-m", "cp_train.cli.export_hf"], "cp-train-export-hf"),
    ([sys.executable, "-m", "cp_train.cli.plot"], "python -m cp_train.cli.plot"),
    ([sys.executable, "-m", "cp_train.cli.prepare_corpus"], "python -m cp_train.cli.prepare_corpus"),
    ([sys.executable, "-m", "cp_train.cli.tiny_hf"], "python -m cp_train.cli.tiny_hf"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Every command below run from a directory outside the checkout, two at a time (each is mostly an
    interpreter's start, on one core): the training commands plan the cpu-tiny run, the others answer --help."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    commands = [(*command, "--config", str(CONFIG), "--dry-run") for command in TRAINING_COMMANDS]
    commands += [(*command, "--help") for command, _ in HELP_COMMANDS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda c: subprocess.run(c, cwd=cwd, capture_output=True, text=True, timeout=180), commands)
        return dict(zip(commands, done, strict=True))


@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_the_training_command_runs_from_any_directory(outcomes, command: list[str]) -> None:
    """train.py, the console script and the ``-m`` forms plan the cpu-tiny run from outside the checkout."""
    done = outcomes[(*command, "--config", str(CONFIG), "--dry-run")]
    assert done.returncode == 0 and done.stdout.startswith("dry run of "), done.stdout + done.stderr


@pytest.mark.parametrize(("command", "prog"), HELP_COMMANDS)
def test_every_command_answers_help_from_any_directory(outcomes, command: list[str], prog: str) -> None:
    done = outcomes[(*command, "--help")]
    assert done.returncode == 0 and done.stdout.startswith(f"usage: {prog}"), done.stdout + done.stderr
