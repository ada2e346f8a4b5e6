"""cp_train.data: tokenizers, Megatron indexed datasets, GPT samples, preprocessing and the embedded corpus.

Loaded lazily (see ``cp_train.parallel``); the loader that splits samples over CP is ``cp_train.data.loader``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {  # public name -> the module that defines it
    "load_tokenizer": "cp_train.data.tokenizers.load",
    "padded_vocab_size": "cp_train.data.tokenizers.load",
    "IndexedDataset": "cp_train.data.indexed",
    "IndexedDatasetWriter": "cp_train.data.indexed",
    "GPTDataset": "cp_train.data.gpt_dataset",
    "preprocess": "cp_train.data.preprocess",
    "prepare_default_corpus": "cp_train.data.default_corpus",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:  # PEP 562: load a name's module on first use
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
