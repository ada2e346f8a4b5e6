"""The one numerical comparison the tests use."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor | float, ref: torch.Tensor | float) -> float:
    """``||x - ref|| / ||ref||`` computed in float64 (the denominator floored at 1e-30)."""
    x = torch.as_tensor(x).detach().to(torch.float64)
    ref = torch.as_tensor(ref).detach().to(torch.float64)
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))
