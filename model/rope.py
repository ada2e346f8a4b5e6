"""Rotary position embeddings (RoPE, rotate-half convention) from global token positions, with scaling.

Positions are the GLOBAL indices of the tokens this rank holds (``sequence_positions``
for the CP layout, or the data loader's position ids), so every CP layout rotates every
token exactly as the unsharded model does; scaling changes only the frequencies (and, for
``yarn``, multiplies cos and sin by the attention factor), never the positions.

Scaling (``ModelConfig.rope_scaling``) follows Hugging Face's ``rope_scaling`` field names and
semantics: ``{"rope_type": "linear", "factor": f}``, ``{"rope_type": "llama3", "factor",
"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` (Llama 3.1) and
``{"rope_type": "yarn", "factor", ["original_max_position_embeddings", "attention_factor",
"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"]}``. ``"type"`` is read as
``"rope_type"`` (older HF configs); ``original_max_position_embeddings`` defaults to the model's
``max_position_embeddings`` as in HF. Frequencies are computed in float64.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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


def _yarn_inv_freq(base: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the low frequencies, keep the high ones, ramp in between."""
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times in the context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return base / scaling["factor"] * ramp + base * (1 - ramp)


def _llama3_inv_freq(base: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                     max_position_embeddings: int = 0) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float64, attention_factor)`` for ``theta`` and ``scaling`` (HF fields, resolved
    against the model's ``max_position_embeddings`` as HF resolves them)."""
    base = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = resolve_rope_scaling(scaling, max_position_embeddings)
    if scaling is None:
        return base, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return base / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(base, scaling), 1.0
    return _yarn_inv_freq(base, head_dim, theta, scaling), float(scaling["attention_factor"])


_FREQUENCIES: dict[tuple, tuple[torch.Tensor, float]] = {}  # device_frequencies' tables, made once per key


def _frozen(value: Any) -> Any:
    """``value`` as a hashable key (dicts and lists of a ``rope_scaling`` made tuples; leaves keep their type,
    so ``True`` and ``1`` differ)."""
    if isinstance(value, dict):
        return tuple(sorted((repr(key), _frozen(item)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    return type(value).__name__, repr(value)


def device_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int,
                       device: torch.device) -> tuple[torch.Tensor, float]:
    """``rope_frequencies`` with ``inv_freq`` on ``device``: computed (float64, on the CPU) and copied there once
    per (head_dim, theta, scaling, max_position_embeddings, device), so a forward makes no host-to-device
    copy. The same values as ``rope_frequencies``; fake tensors (tracing) are not kept."""
    key = (head_dim, theta, _frozen(scaling), max_position_embeddings, str(device))
    found = _FREQUENCIES.get(key)
    if found is None:
        inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, max_position_embeddings)
        found = (inv_freq.to(device), attention_factor)
        if type(found[0]) is torch.Tensor:
            _FREQUENCIES[key] = found
    return found


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
                scaling: dict[str, Any] | None = None, max_position_embeddings: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[B, n, 1, head_dim/2]`` in ``dtype``, for int positions ``[B, n]``.

    Angles are formed in float64 so that long sequences keep their precision. With ``scaling``
    (see the module docstring) the frequencies are scaled and cos/sin carry yarn's attention factor.
    The frequencies come from ``device_frequencies`` (on ``positions``' device already after the first call).
    """
    if positions.dim() != 2 or positions.is_floating_point():
        raise ValueError(f"positions must be an integer tensor [batch, seqlen], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    inv_freq, attention_factor = device_frequencies(head_dim, theta, scaling, max_position_embeddings,
                                                    positions.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [B, n, D/2]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, n, heads, D]`` by the tables of ``rope_tables``; same shape and dtype as ``x``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
