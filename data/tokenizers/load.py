"""Opening a tokenizer file of either kind: a SentencePiece ``.model`` or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import os
from pathlib import Path

from cp_train.data.tokenizers.spm import Tokenizer
from cp_train.data.tokenizers.vocab import padded_vocab_size

__all__ = ["load_tokenizer", "padded_vocab_size"]

PathLike = str | os.PathLike


def load_tokenizer(path: PathLike) -> Tokenizer:
    """The tokenizer at ``path``: a Hugging Face ``tokenizer.json`` (or a directory holding one) through the
    ``tokenizers`` library (``hf.HFTokenizer``), otherwise a SentencePiece model."""
    path = Path(path)
    if not path.exists() and path.suffix != ".model":
        raise FileNotFoundError(f"tokenizer {path} is missing: pass a SentencePiece .model file, a Hugging Face "
                                f"tokenizer.json, or a directory holding tokenizer.json")
    if path.is_dir() or path.suffix == ".json":
        from cp_train.data.tokenizers.hf import HFTokenizer  # imports the tokenizers library only when needed
        return HFTokenizer(path)  # type: ignore[return-value]  # the same interface
    return Tokenizer(path)
