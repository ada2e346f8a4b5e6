"""cp_train.data: tokenizers, Megatron indexed datasets, GPT samples, preprocessing and the embedded corpus.

Loaded lazily (see ``cp_train.parallel``); the loader that splits samples over CP is ``cp_train.data.loader``.
"""

from __future__ import annotations

from cp_train.lazy_exports import lazy_exports

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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
