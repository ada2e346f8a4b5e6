"""Every code block of the docs (``docs/*.md`` and the README) that is a command or a Python snippet is checked.

- A Python block runs verbatim on 2 spawned gloo ranks (``tests/doc_cases.py``); a fragment names the inputs the
  reader's code would give it with ``<!-- run with: PRELUDE -->`` on the line above the block (``PRELUDES``).
- A command block (``bash``, or an unlabelled block whose lines start with ``$ `` or with a known program) has each
  command's arguments parsed by the program's own parser: ``train.py`` (through torchrun, ``cp-train-launch``,
  ``launch/torchrun.sh`` or ``sbatch launch/slurm.sbatch``) builds its config from the YAML, the flags and
  ``--set``; every other ``cp_train`` command stops right after its argparse parse; other modules must import and
  named paths exist.
- A block that cannot be checked here says why with ``<!-- not run: REASON -->`` on the line above it.

Other blocks (output, diagrams, YAML, JSON) are text.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from torch.distributed.run import parse_args as torchrun_args

from cp_train.config.flags import build_parser, parse_args
from cp_train.config.schema import ConfigError
from tests import doc_cases

REPO = Path(__file__).resolve().parents[2]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!-- (not run|run with): (.+?) -->")
SCRIPTS = dict(re.findall(r'^(cp-train[\w-]*) = "([\w.:]+)"', (REPO / "pyproject.toml").read_text(), re.M))
LAUNCHERS = ("torchrun", "cp-train-launch")
TRAIN_MODULES = ("cp_train", "cp_train.cli.train")
MAINS = {"cp_train.eval": "cp_train.eval.cli:main", "cp_train.plan": "cp_train.cli.plan:main",
         "cp_train.perf": "cp_train.cli.plan:main"}
NOT_OURS = {"pip": "installs packages"}  # run by a reader, never by the tests
PARSERS = {"cp_train.cli.plan:main": "cp_train.cli.plan:build_parser"}  # mains that act before parse_args


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    body: str
    marker: tuple[str, str] | None  # ("not run" | "run with", text)

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def doc_blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            found.append(Block(page, text[:match.start()].count("\n") + 1, match.group(1), match.group(2),
                               marker.groups() if marker else None))
    return found


def _programs() -> set[str]:
    return {*SCRIPTS, *LAUNCHERS, "python", "launch/torchrun.sh", "sbatch", *NOT_OURS}


def commands(block: Block) -> list[list[str]] | None:
    """The block's commands as argv lists (continuations joined, comments, ``&&`` and ``VAR=value`` prefixes
    dropped), or None when the block is not a command block."""
    lines = block.body.replace("\\\n", " ").splitlines()
    if block.language == "":
        prompted = [line[2:] for line in lines if line.startswith("$ ")]
        first = (lines[0].split() or [""])[0] if lines else ""
        if not prompted and first not in _programs():
            return None
        lines = prompted or lines
    elif block.language not in ("bash", "sh", "shell", "console"):
        return None
    found: list[list[str]] = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            command, words = words[:cut], words[cut + 1:]
            if command and re.fullmatch(r"[A-Z_]+=\$\(.*", command[0]):
                continue  # VAR=$(...): the shell's
            while command and re.fullmatch(r"[A-Z_]+=.*", command[0]):
                command = command[1:]  # VAR=value prefixes; a line of assignments alone is shell, not a command
            if command:
                found.append(command)
    return found


class _Parsed(SystemExit):
    """Raised in place of running a command once its parser accepted the arguments."""


def parse_only(main: Callable[[list[str]], object], argv: list[str]) -> None:
    """Run ``main(argv)`` up to its first argparse ``parse_args``; AssertionError when that rejects ``argv``."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser: argparse.ArgumentParser, args=None, namespace=None):  # noqa: ANN001, ANN202
        original(parser, args, namespace)
        raise _Parsed(0)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except _Parsed:
            return
        except SystemExit as stop:
            raise AssertionError(f"{argv} rejected (exit {stop.code})") from None
    raise AssertionError(f"{main.__module__}.{main.__name__} parsed {argv} without argparse's parse_args")


def check_train(argv: list[str]) -> None:
    """train.py's arguments: no unknown flag, and the config they build (YAML < flags < --set) loads; a missing
    ``--init-from-hf`` directory (a placeholder) is left out."""
    _, unknown = build_parser().parse_known_args(argv)
    assert not unknown, f"train.py does not take {unknown}"
    kept, skip = [], False
    for word in argv:
        if skip or word.startswith("--init-from-hf="):
            skip = False
            continue
        if word == "--init-from-hf":
            skip = True
            continue
        kept.append(word)
    parse_args(kept)


def _main(spec: str) -> Callable[[list[str]], object]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def check_main(spec: str, args: list[str]) -> None:
    """``args`` of the command whose main is ``spec`` (``module:function``), parsed by its own parser."""
    if spec in PARSERS:
        try:
            _main(PARSERS[spec])().parse_args(args)
        except SystemExit as stop:
            raise AssertionError(f"{args} rejected (exit {stop.code})") from None
        return
    parse_only(_main(spec), args)


def check_module(module: str, args: list[str]) -> None:
    """``python -m module args``."""
    if module in TRAIN_MODULES:
        return check_train(args)
    if module in MAINS or module.startswith("cp_train."):
        return check_main(MAINS.get(module, f"{module}:main"), args)
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    if module == "pytest":
        paths = [arg for arg in args if not arg.startswith("-")]
        assert all((REPO / path.split("::")[0]).exists() for path in paths), paths


def check_command(argv: list[str]) -> None:
    program, args = argv[0], argv[1:]
    if program in NOT_OURS:
        return
    if program in LAUNCHERS:
        options = torchrun_args(args)
        script = options.training_script
        if options.module:
            return check_module(script, options.training_script_args)
        assert Path(script).name == "train.py" and (REPO / script).is_file(), script
        return check_train(options.training_script_args)
    if program == "python":
        if args[0] == "-m":
            return check_module(args[1], args[2:])
        assert Path(args[0]).name == "train.py" and (REPO / args[0]).is_file(), args
        return check_train(args[1:])
    if program == "launch/torchrun.sh":
        assert (REPO / program).is_file()
        return check_train(["--config", *args])
    if program == "sbatch":
        script = next(i for i, word in enumerate(args) if word.endswith(".sbatch"))
        assert (REPO / args[script]).is_file(), args[script]
        return check_train(["--config", *args[script + 1:]])
    assert program in SCRIPTS, f"{program}: not a command these docs may name (mark the block <!-- not run: ... -->)"
    if SCRIPTS[program] == "cp_train.cli.train:console_main":
        return check_train(args)
    if SCRIPTS[program] == "cp_train.cli.launch:console_main":
        raise AssertionError("unreachable: cp-train-launch is a launcher")
    return check_main(SCRIPTS[program].replace(":console_main", ":main"), args)  # console_main ends the process


BLOCKS = doc_blocks()
COMMAND_BLOCKS = [b for b in BLOCKS if b.marker is None and commands(b)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.language == "python" and (b.marker is None or b.marker[0] == "run with")]


def test_every_block_is_checked_or_says_why_not() -> None:
    for block in BLOCKS:
        if block.marker is None:
            continue
        kind, text = block.marker
        if kind == "run with":
            assert block.language == "python" and text in doc_cases.PRELUDES, f"{block}: {text}"
        else:
            assert len(text) > 8, f"{block}: say why it is not run"
    assert len(COMMAND_BLOCKS) >= 15 and len(PYTHON_BLOCKS) >= 5


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=str)
def test_command_blocks_parse(block: Block, capsys) -> None:
    for argv in commands(block):
        try:
            check_command(argv)
        except (AssertionError, ConfigError) as error:
            raise AssertionError(f"{block}: {shlex.join(argv)}: {error}") from None
    capsys.readouterr()  # the parsers' output


def test_python_blocks_run(spawn_world, tmp_path: Path) -> None:
    for index, block in enumerate(PYTHON_BLOCKS):
        prelude = block.marker[1] if block.marker else "nothing"
        workdir = tmp_path / str(index)
        workdir.mkdir()
        try:
            spawn_world(2).run(doc_cases.run_snippet, block.body, prelude, str(workdir))
        except Exception as error:  # noqa: BLE001 - named by its block
            raise AssertionError(f"{block} (run with {prelude}): {error}") from None
