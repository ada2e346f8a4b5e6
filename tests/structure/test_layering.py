"""The package's layers, read from every module's imports with ``ast`` (docs/architecture.md):

- ``cp_train.parallel`` imports nothing from the model, the data or the trainer;
- ``cp_train.model`` imports only ``cp_train.parallel``;
- ``cp_train.data`` imports only the layouts of ``cp_train.parallel.cp``;
- inside ``cp_train``, three layers: the low pieces (``errors``, ``results``, ``optim``, ``loss``, ``preemption`` and
  the config, checkpoint, metrics and memory packages) below the training loop (``trainer``, ``build``,
  ``run_parts``, ``run_log``) below the commands (``cp_train.cli``): nothing imports a layer above its own;
- the planner (``cp_train.perf``) and the long-context eval (``cp_train.eval``) sit above the trainer's pieces:
  only the trainer loop, the commands and themselves import them, and neither imports the other;
- no folder-level cycle: the packages (and the root's modules) import each other in one direction;
- ``cp_train.parallel.mesh`` does not load the kernels, read statically and checked in a fresh interpreter;
- the library imports modules, never its own public faces (the lazy ``__init__``s), and no import cycle exists;
- ``cp_train.lazy_exports`` (the faces' loader, importlib only) is below every layer: any package may import it.

The packages listed in ``pyproject.toml`` are exactly the folders that hold an ``__init__.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"cp_train": "cp_train", "parallel": "cp_train.parallel", "model": "cp_train.model", "data": "cp_train.data"}
LAYOUT_MODULES = {"cp_train.parallel.cp.layout", "cp_train.parallel.cp.balanced_layout"}
FACES = {"cp_train", "cp_train.parallel", "cp_train.model", "cp_train.data"}
BELOW_ALL = {"cp_train.lazy_exports"}  # what the faces import to load lazily: importlib only
TRAINER_LOOP = ("cp_train.trainer", "cp_train.build", "cp_train.run_parts", "cp_train.run_log")
TRAINER_PACKAGES = ("cp_train.config", "cp_train.checkpoint", "cp_train.metrics", "cp_train.memory", "cp_train.runtime")
LOW_MODULES = ("cp_train.errors", "cp_train.results", "cp_train.optim", "cp_train.loss", "cp_train.preemption")
UPPER = {"cp_train.perf": "cp_train.eval", "cp_train.eval": "cp_train.perf"}  # above the pieces, beside each other


def _module_files() -> dict[str, Path]:
    """Every module of the installed package by dotted name (``pkg/__init__.py`` as ``pkg``)."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _module_files()


def _imports(name: str, path: Path) -> Iterator[str]:
    """The project modules ``name`` imports (anywhere in the file): ``from pkg import module`` names the module,
    ``from pkg import value`` the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        yield from (target for target in targets if target.split(".")[0] == "cp_train")


GRAPH = {name: set(_imports(name, path)) for name, path in MODULES.items()}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(source: str, allowed) -> list[str]:  # noqa: ANN001 - a predicate on the imported name
    return [f"{name} imports {target}" for name in GRAPH if _under(name, source)
            for target in sorted(GRAPH[name]) if not allowed(target) and target not in BELOW_ALL]


def test_pyproject_packages_are_every_folder_with_an_init() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert set(project["packages"]) == packages
    assert {key: ROOT / value for key, value in project["package-dir"].items()} == {
        package: ROOT / folder for folder, package in FOLDERS.items()}


def test_every_module_belongs_to_a_package() -> None:
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert [name for name, path in MODULES.items() if path.name != "__init__.py"
            and name.rpartition(".")[0] not in packages] == []


def test_parallel_imports_only_itself() -> None:
    assert _violations("cp_train.parallel", lambda t: _under(t, "cp_train.parallel")) == []


def test_model_imports_only_parallel() -> None:
    assert _violations("cp_train.model", lambda t: _under(t, "cp_train.model") or _under(t, "cp_train.parallel")) == []


def test_data_imports_only_the_layouts() -> None:
    assert _violations("cp_train.data", lambda t: _under(t, "cp_train.data") or t in LAYOUT_MODULES) == []


def _entry(name: str) -> bool:
    """``python -m`` entry points (``__main__``), which start a command."""
    return name.endswith("__main__")


def test_nothing_below_the_commands_imports_them() -> None:
    below = [name for name in GRAPH if not _under(name, "cp_train.cli") and not _entry(name)]
    assert [f"{name} imports {t}" for name in below for t in GRAPH[name] if _under(t, "cp_train.cli")] == []


@pytest.mark.parametrize("low", TRAINER_PACKAGES + LOW_MODULES)
def test_the_low_pieces_sit_below_the_loop_and_the_commands(low: str) -> None:
    """The low pieces serve the training loop and never import it, the commands, the planner or the eval."""
    def above(target: str) -> bool:
        return target in TRAINER_LOOP or any(_under(target, p) for p in ("cp_train.cli", *UPPER))
    assert _violations(low, lambda t: not above(t)) == []


@pytest.mark.parametrize("package", sorted(UPPER))
def test_only_the_loop_and_the_commands_import_the_planner_and_the_eval(package: str) -> None:
    def may_import(name: str) -> bool:
        return (_under(name, package) or _under(name, "cp_train.cli") or name in TRAINER_LOOP or _entry(name))
    assert [f"{name} imports {t}" for name in GRAPH if not may_import(name) for t in GRAPH[name]
            if _under(t, package)] == []
    assert _violations(package, lambda t: not _under(t, UPPER[package])) == []


def _folder(name: str) -> str:
    """The package folder of a module (``cp_train.perf.inputs.runs`` -> ``cp_train.perf``); the root's modules,
    which mix layers, stand alone."""
    parts = name.split(".")
    if parts[0] != "cp_train" or len(parts) < 3 and name not in MODULES:
        return name
    package = ".".join(parts[:2])
    return package if package in MODULES and MODULES[package].name == "__init__.py" else name


def test_no_folder_level_cycle() -> None:
    folders: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        if not _entry(name):
            folders.setdefault(_folder(name), set()).update(_folder(t) for t in targets if _folder(t) != _folder(name))
    cycles = _cycles(folders)
    assert cycles == [], cycles


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(GRAPH.get(name, ()))
    return seen


def test_mesh_does_not_load_the_kernels_statically() -> None:
    for name in GRAPH:
        if _under(name, "cp_train.parallel.mesh"):
            assert not [m for m in _closure(name) if _under(m, "cp_train.parallel.kernels")], name


def test_mesh_does_not_load_the_kernels_at_run_time() -> None:
    code = ("import sys, cp_train.parallel.mesh.state, cp_train.parallel.mesh.model_parallel; "
            "print(sorted(m for m in sys.modules if m.startswith(('cp_train.parallel.kernels', 'cp_train.model', "
            "'cp_train.data', 'cp_train.parallel.cp.ring'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_commands_start_without_dynamo_fsdp_or_the_trainer() -> None:
    """``train.py``'s config and input errors, ``--help`` and evaluation's start do not pay for Dynamo (half a
    second of every start: ``constant_to_compile``); the optimizer and ``--compile`` load it when they run. The
    training command loads FSDP, DTensor and the trainer only once the config holds (0.8 s of every start)."""
    code = ("import sys, cp_train.cli.train; loaded = set(sys.modules); import cp_train.eval; "
            "print(sorted({m for m in loaded if m in ('torch.distributed.fsdp', 'torch.distributed.tensor', "
            "'torch.distributed.checkpoint', 'cp_train.trainer')} | {m for m in sys.modules if m == 'torch._dynamo'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["--config", "launch/configs/cpu-tiny.yaml", "--bogus"],
                                  ["--config", "launch/configs/cpu-tiny.yaml", "--data-path", "/nonexistent/corpus"]])
def test_the_help_and_a_flags_error_answer_without_torch(argv: list[str]) -> None:
    """``train.py --help``, a misspelt flag and a missing data file answer from the config's modules alone: torch
    (about 1.5 s) is imported once the command line has parsed and the run's files are there."""
    done = subprocess.run([sys.executable, "-X", "importtime", "train.py", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "cp_train.config.flags" in loaded and "torch" not in loaded, sorted(m for m in loaded if "torch" in m)
    if argv == ["--help"]:
        assert done.returncode == 0 and "--cp-size" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == 2 and ("unrecognized arguments: --bogus" in done.stderr or
                                         "/nonexistent/corpus.idx is missing" in done.stderr), done.stderr[-2000:]


def test_the_library_imports_modules_not_its_public_faces() -> None:
    inside = [name for name in GRAPH if name not in FACES and not _under(name, "cp_train.cli")
              and name != "cp_train.__main__"]
    assert [f"{name} imports {t}" for name in inside for t in GRAPH[name] if t in FACES] == []


def _cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected components of more than one node of ``graph`` (default: the modules; Tarjan)."""
    graph = GRAPH if graph is None else graph
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_the_checks_see_a_violation(monkeypatch) -> None:
    """The rules are live: an upward import and a cycle, added to the graph, are reported."""
    monkeypatch.setitem(GRAPH, "cp_train.parallel.cp.layout", GRAPH["cp_train.parallel.cp.layout"] | {
        "cp_train.model.gpt"})
    assert _violations("cp_train.parallel", lambda t: _under(t, "cp_train.parallel")) == [
        "cp_train.parallel.cp.layout imports cp_train.model.gpt"]
    monkeypatch.setitem(GRAPH, "cp_train.model.gpt", GRAPH["cp_train.model.gpt"] | {"cp_train.model.block"})
    monkeypatch.setitem(GRAPH, "cp_train.model.block", GRAPH["cp_train.model.block"] | {"cp_train.model.gpt"})
    assert any({"cp_train.model.block", "cp_train.model.gpt"} <= set(cycle) for cycle in _cycles())
    monkeypatch.setitem(GRAPH, "cp_train.metrics.throughput", GRAPH["cp_train.metrics.throughput"] | {
        "cp_train.perf.predict"})  # metrics <-> perf: a folder cycle, and metrics below the planner
    with pytest.raises(AssertionError):
        test_no_folder_level_cycle()
    with pytest.raises(AssertionError):
        test_only_the_loop_and_the_commands_import_the_planner_and_the_eval("cp_train.perf")


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_no_folder_holds_more_than_ten_modules(folder: str) -> None:
    for directory in [ROOT / folder, *(p.parent for p in (ROOT / folder).rglob("*/__init__.py"))]:
        modules = [p for p in directory.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        assert len(modules) <= 10, f"{directory.relative_to(ROOT)} holds {len(modules)} modules"
