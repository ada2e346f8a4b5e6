"""A package face loaded lazily (PEP 562): the package lists ``name -> defining module`` and its names load their
module on first use, so ``import cp_train.parallel`` alone imports nothing heavy."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``package`` (its ``__name__``) whose public names are ``exports``
    (name -> the module that defines it); ``namespace``: the package's ``globals()``."""

    def getattr_(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
