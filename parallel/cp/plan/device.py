"""Where a CP plan's index tensors live: the row selectors a plan holds, and moving a plan to a device once.

A plan is built on the CPU. Its index tensors (``Selector``) move with the micro-batch (``to``, ahead of the
forward), or once on first use (``MovedOnce.on_device``) for a caller that did not move it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Selector = slice | torch.Tensor | None  # rows picked from a compacted store (None: nothing)
CPU = torch.device("cpu")
Apply = Callable[[torch.Tensor], torch.Tensor]  # what a move or a pin does to one index tensor


def apply_rows(rows: Selector, fn: Apply) -> Selector:
    """``fn(rows)`` for an index tensor; a slice or None as it is."""
    return fn(rows) if isinstance(rows, torch.Tensor) else rows


def plan_device(device: torch.device | str) -> torch.device:
    """``device`` as tensors moved there report it (``cuda`` -> ``cuda:0`` on device 0)."""
    device = torch.device(device)
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    return torch.empty(0, device=device).device


class MovedOnce:
    """``on_device`` for a plan with ``device``, ``cache`` and ``to(device)``: the plan itself when its index
    tensors are on ``device`` (moved ahead by ``to``, or a CPU plan on the CPU); else a copy moved once and
    cached, for a caller that did not move the plan."""

    def on_device(self, device: torch.device):  # noqa: ANN201 - the plan's own type
        if device == self.device:
            return self
        key = ("plan", str(device))
        if key not in self.cache:
            self.cache[key] = self.to(device)
        return self.cache[key]
