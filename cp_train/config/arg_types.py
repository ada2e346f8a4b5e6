"""argparse types for the commands' numeric flags, actions for flags of several words, and a parser whose usage
errors are one line.

A bad value is argparse's error naming the flag and what it takes (``argument --gpus: must be a positive
integer, got '0'``); ``OneLineParser`` makes any usage error an ``InputError``, which ``run_entry_point`` prints
as one line with exit code 2 instead of the usage text (``cp_train/errors.py``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn

from cp_train.errors import InputError


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (a share)."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text!r}")
    return value


def megatron_split(text: str) -> float:
    """Megatron-LM's ``--split 969,30,1`` (train, valid and test weights of the documents, in that order; commas or
    slashes, missing ones 0) as the held-out share of the documents: (valid + test) / all. The training documents
    are then Megatron-LM's (the first), and the validation reads its valid and test documents."""
    try:
        weights = [float(word) for word in text.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or not weights[0] > 0:
        raise argparse.ArgumentTypeError(f"takes the train,valid,test weights of the documents, such as 969,30,1, "
                                         f"got {text!r}")
    return sum(weights[1:]) / sum(weights)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors raise ``InputError`` (``MESSAGE (see PROG --help)``), not the usage
    text and ``SystemExit``; ``--help`` still prints and exits 0."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message} (see {self.prog} --help)")


class JoinedWords(argparse.Action):
    """A flag's words as one space-separated value (``data.prefix``'s blend form, ``data/blended.py``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, " ".join(values))


class ListWords(argparse.Action):
    """A flag's words as a list key's comma-separated value (``--profile-ranks 0 4`` is ``0,4``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, ",".join(values))
