"""The embedding's vocabulary size: the tokenizer's, padded as Megatron pads it."""

from __future__ import annotations

import math


def padded_vocab_size(vocab_size: int, tp: int = 1, multiple: int = 128) -> int:
    """Smallest multiple of ``multiple * tp`` that is >= ``vocab_size`` (Megatron's padding)."""
    if tp < 1 or multiple < 1:
        raise ValueError(f"tp ({tp}) and multiple ({multiple}) must be positive")
    step = multiple * tp
    return math.ceil(vocab_size / step) * step
