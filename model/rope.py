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

from cp_train.model.hf.rope_scaling import resolve_rope_scaling


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
