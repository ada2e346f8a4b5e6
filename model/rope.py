"""Rotary position embeddings (RoPE, rotate-half convention) from global token positions.

Positions are the GLOBAL indices of the tokens this rank holds (``sequence_positions``
for the CP layout, or the data loader's position ids), so every CP layout rotates every
token exactly as the unsharded model does.
"""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[B, n, 1, head_dim/2]`` in ``dtype``, for int positions ``[B, n]``.

    Angles are formed in float64 so that long sequences keep their precision.
    """
    if positions.dim() != 2 or positions.is_floating_point():
        raise ValueError(f"positions must be an integer tensor [batch, seqlen], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [B, n, D/2]
    return angles.cos().to(dtype).unsqueeze(2), angles.sin().to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, n, heads, D]`` by the tables of ``rope_tables``; same shape and dtype as ``x``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
