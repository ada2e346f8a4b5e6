"""Hugging Face's ``rope_scaling`` fields (``ModelConfig.rope_scaling``), resolved and checked as HF fills and checks
them: what the config reads of RoPE, without torch (the frequencies are ``model/rope.py``'s)."""

from __future__ import annotations

import math
from typing import Any

ROPE_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {  # type -> (required, optional) fields
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
               frozenset({"original_max_position_embeddings"})),
    "yarn": (frozenset(), frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                                     "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
}
_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim")


def _number(scaling: dict[str, Any], key: str, minimum: float, strict: bool = False) -> None:
    value = scaling.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum or (
            strict and value == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"rope_scaling.{key} must be a number {bound}, got {value!r}")


def resolve_rope_scaling(scaling: dict[str, Any] | None, max_position_embeddings: int) -> dict[str, Any] | None:
    """The complete scaling of ``scaling`` (HF fields, defaults filled in as HF fills them), or None for none.

    Raises ``ValueError`` naming the field for an unknown ``rope_type`` (listing the known ones), a
    missing or unknown field, or a value out of range.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a mapping such as {{rope_type: llama3, factor: 8, ...}}, "
                         f"got {scaling!r}")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None)
    alias = scaling.pop("type", None)
    if kind is not None and alias is not None and kind != alias:
        raise ValueError(f"rope_scaling has rope_type {kind!r} and type {alias!r}; keep one")
    kind = kind or alias
    if kind is None and any(isinstance(key, str) and ":" in key for key in scaling):
        raise ValueError(f"rope_scaling {scaling!r} reads as keys without values: in YAML put a space after each "
                         f"colon, e.g. {{rope_type: yarn, factor: 4.0}}")
    if kind == "dynamic":
        raise ValueError("rope_scaling.rope_type 'dynamic' cannot be trained: its theta depends on the current "
                         "sequence length, so every length would be another model; use linear, llama3 or yarn")
    if kind not in ROPE_TYPES:
        raise ValueError(f"unknown rope_scaling.rope_type {kind!r}; known types: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        if scaling:
            raise ValueError(f"rope_scaling of rope_type 'default' takes no fields, got {', '.join(sorted(scaling))}")
        return None
    required, optional = ROPE_TYPES[kind]
    missing = sorted(required - scaling.keys())
    unknown = sorted(scaling.keys() - required - optional)
    if missing:
        raise ValueError(f"rope_scaling of rope_type {kind!r} is missing {', '.join(missing)}")
    if unknown:
        raise ValueError(f"rope_scaling of rope_type {kind!r} does not take {', '.join(unknown)}; its fields are "
                         f"{', '.join(sorted(required | optional))}")
    for key in _NUMBERS:
        _number(scaling, key, 1.0 if key == "factor" else 0.0, strict=key not in ("factor", "mscale",
                                                                                  "mscale_all_dim"))
    original = scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    if kind == "linear":
        del scaling["original_max_position_embeddings"]
    elif isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling.original_max_position_embeddings must be an integer >= 1, got {original!r}")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling.high_freq_factor ({scaling['high_freq_factor']}) must be larger than "
                         f"low_freq_factor ({scaling['low_freq_factor']})")
    if kind == "yarn":
        _resolve_yarn(scaling, max_position_embeddings)
    return {"rope_type": kind, **scaling}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _resolve_yarn(scaling: dict[str, Any], max_position_embeddings: int) -> None:
    if scaling.get("factor") is None:  # HF: the ratio of the new to the original context
        scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    if scaling.get("attention_factor") is None:
        factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling["attention_factor"] = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling["attention_factor"] = _yarn_mscale(factor)
    scaling["beta_fast"] = scaling.get("beta_fast") or 32
    scaling["beta_slow"] = scaling.get("beta_slow") or 1
    truncate = scaling.setdefault("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"rope_scaling.truncate must be true or false, got {truncate!r}")
