"""cp-train: Megatron-style context-parallel pretraining of long-context GPT models.

One installed package: the trainer and its commands here, with ``cp_train.model``, ``cp_train.parallel`` and
``cp_train.data`` (the folders ``model/``, ``parallel/`` and ``data/`` of the checkout). Loaded lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {  # public name -> the module that defines it
    "Config": "cp_train.config.schema",
    "build_config": "cp_train.config.sources",
    "Trainer": "cp_train.trainer",
    "run_training": "cp_train.trainer",
    "main": "cp_train.cli.train",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:  # PEP 562: load a name's module on first use
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
