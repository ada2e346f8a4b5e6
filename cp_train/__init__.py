"""cp-train: Megatron-style context-parallel pretraining of long-context GPT models.

One installed package: the trainer and its commands here, with ``cp_train.model``, ``cp_train.parallel`` and
``cp_train.data`` (the folders ``model/``, ``parallel/`` and ``data/`` of the checkout). Loaded lazily.
"""

from __future__ import annotations

from cp_train.lazy_exports import lazy_exports

_EXPORTS = {  # public name -> the module that defines it
    "Config": "cp_train.config.schema",
    "build_config": "cp_train.config.sources",
    "Trainer": "cp_train.trainer",
    "run_training": "cp_train.trainer",
    "main": "cp_train.cli.train",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
