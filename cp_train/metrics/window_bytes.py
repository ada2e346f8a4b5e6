"""K/V bytes a CP rank receives per attention layer, by the layer's window: the setup record's
``kv_bytes_per_layer`` (what a sliding window saves in communication, ``parallel/cp/plan/window_plan.py``).

Counted from the static plan of one document per sample (the plan ``layout_plan`` gives for the run's algorithm,
layout and this rank; the balanced layout places one document as zigzag), per micro-batch, forward; the backward
receives the K/V again and returns dK/dV."""

from __future__ import annotations

import torch

from cp_train.parallel.cp.algorithms.registry import CPAlgorithm
from cp_train.parallel.cp.plan.batch_plan import layout_plan
from cp_train.parallel.cp.plan.window_plan import as_window, kv_bytes_received


def kv_bytes_per_layer(windows: list[int | None], algorithm: CPAlgorithm, layout: str, cp: int, rank: int, ulysses: int,
                       local_len: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype
                       ) -> dict[str, int]:
    """``{"full" | "window W": bytes}`` for each distinct entry of ``windows`` (the model's per-layer windows,
    None: full attention); ``algorithm`` the run's; ``ulysses`` its subgroups' size (1 without); ``kv_heads`` this
    rank's (after TP). Empty without CP."""
    if cp == 1:
        return {}
    layout = "zigzag" if layout == "balanced" else layout
    out = {}
    for window in sorted(set(windows), key=lambda w: -1 if w is None else w):
        plan = layout_plan(algorithm, layout, cp, rank, local_len, ulysses, True,
                           None if window is None else as_window(window, True))
        name = "full" if window is None else f"window {window}"
        out[name] = kv_bytes_received(plan, batch, local_len, kv_heads, head_dim, dtype)
    return out
