"""No module defines one name twice in one scope (a module's or a class's functions and classes): the later
definition silently replaces the earlier one, and every call then runs the later. ruff's F811 does not report a
function defined twice when a later function calls it (``config/validate.py`` once held two ``_check_replicas``: the
HSDP check was never run). ``_`` is exempt: ``torch.library``'s registrations name their functions so."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("cp_train", "model", "parallel", "data", "bench", "tests")
EXEMPT = {"_"}


def _python_files() -> Iterator[Path]:
    yield from sorted(ROOT.glob("*.py"))
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def defined_twice(source: str) -> list[str]:
    """``scope.name`` for every function or class defined more than once in one module or class body."""
    found: list[str] = []

    def scan(body: list[ast.stmt], scope: str) -> None:
        names = Counter()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] += 1
                if isinstance(node, ast.ClassDef):
                    scan(node.body, f"{scope}{node.name}.")
        found.extend(f"{scope}{name}" for name, count in names.items() if count > 1 and name not in EXEMPT)

    scan(ast.parse(source).body, "")
    return found


def test_no_module_defines_a_name_twice() -> None:
    files = list(_python_files())
    assert len(files) > 300  # the project's modules, its benchmarks and its tests were found
    twice = {str(path.relative_to(ROOT)): names for path in files if (names := defined_twice(path.read_text()))}
    assert not twice, twice


def test_the_check_sees_a_second_definition() -> None:
    source = ("def check(x):\n    return 1\n\n\ndef check(x):\n    return 2\n\n\ndef run():\n    return check(0)\n\n\n"
              "class Step:\n    def go(self):\n        pass\n\n    def go(self):\n        pass\n\n\n"
              "def _(x):\n    pass\n\n\ndef _(x):\n    pass\n")
    assert defined_twice(source) == ["Step.go", "check"]
