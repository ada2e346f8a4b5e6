"""A blend of datasets as the config names it (``data.prefix``, ``data.valid_prefix``): Megatron-LM's ``--data-path``
forms parsed, and the weights of a blend weighed by its datasets' tokens; what the config's checks read, without
torch (``blended.py`` serves the blend's samples)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

Blend = tuple[tuple[float | None, str], ...]  # (weight, prefix) pairs; weight None: by the dataset's size


def _weight(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def parse_blend(spec: str, key: str = "data.prefix") -> Blend:
    """``(weight, prefix)`` pairs of a data key (``key``): one prefix (weight 1; also one whose path holds spaces,
    when its ``.idx`` exists); ``W1 PREFIX1 W2 PREFIX2 ...`` with positive weights (normalised where used); or
    ``PREFIX1 PREFIX2 ...`` without weights (each ``None``: weighed by its tokens, as Megatron-LM weighs a blend
    without weights by the datasets' sizes). ``ValueError`` with the forms to use otherwise."""
    words = spec.split()
    if len(words) == 1 or (len(words) > 1 and Path(spec + ".idx").is_file()):
        return ((1.0, spec.strip()),)
    weights = [_weight(word) for word in words]
    if len(words) > 1 and all(weight is None for weight in weights):
        return tuple((None, word) for word in words)
    pairs: list[tuple[float | None, str]] = []
    if words and len(words) % 2 == 0 and all(weights[i] is not None for i in range(0, len(words), 2)):
        pairs = [(weights[i], words[i + 1]) for i in range(0, len(words), 2)]
    if not pairs or not all(math.isfinite(weight) and weight > 0 for weight, _ in pairs):  # type: ignore[arg-type]
        raise ValueError(f"{key} {spec!r}: a blend of datasets is 'WEIGHT PREFIX WEIGHT PREFIX ...' with "
                         f"positive weights (as Megatron-LM's --data-path 0.7 data/web 0.3 data/code), or "
                         f"'PREFIX PREFIX ...' weighed by their tokens; one dataset is its prefix alone")
    return tuple(pairs)


def size_weights(blend: Blend, tokens: Sequence[int]) -> list[float]:
    """The blend's weights, each unset one (``None``) taken from ``tokens``, its dataset's tokens in the split."""
    return [float(count) if weight is None else weight for (weight, _), count in zip(blend, tokens, strict=True)]
