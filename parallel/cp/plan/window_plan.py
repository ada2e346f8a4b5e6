"""Sliding windows in CP plans: the one internal form, the halo exchange's choice, and the K/V traffic.

One convention inside: ``Window(left, right)`` (``segments.py``), keys ``i - left ... i + right`` around query
``i`` of its document, None unbounded. At the boundaries:

- ``window=W`` (an int, HF's ``sliding_window``): W keys including the query itself, ``Window(W - 1, 0)``
  causal; not causal, the symmetric ``Window(W - 1, W - 1)``.
- ``window_size=(left, right)`` (flash-attn's; -1 unbounded): ``Window(left, right)``, ``right`` > 0 only
  without causal. Never hand a kernel a negative computed left: flash-attn reads any negative as unbounded.

The plan puts the window into the mask predicate (``visible_intervals``), so its segments, byte counts and
areas, the balanced layout's work and the planner all see it. ``halo_is_cheaper`` decides, from every rank
pair's segments, whether the ring runs as a halo exchange (each rank receives the rows it uses straight
from their owners, both directions: zigzag with a window) or as the one-way ring (contiguous: the ring
truncated to the hops that carry anything).
"""

from __future__ import annotations

import torch

from cp_train.parallel.cp.plan.segments import Interval, Segment, Window, size, union

__all__ = ["Window", "as_window", "flash_window", "halo_is_cheaper", "kv_bytes_received", "kv_rows_received"]


def as_window(window: int | tuple[int, int] | Window | None, causal: bool) -> Window | None:
    """The internal ``Window`` of a public ``window`` (see the module docstring); None: unbounded.
    ``ValueError`` saying what to change for a window that cannot be."""
    if window is None or isinstance(window, Window):
        return window
    if isinstance(window, bool) or not isinstance(window, (int, tuple, list)):
        raise ValueError(f"window must be an int W (keys seen, the query included) or flash-attn's "
                         f"(left, right), got {window!r}")
    if isinstance(window, int):
        if window < 1:
            raise ValueError(f"window={window}: a sliding window sees W >= 1 keys (the query included); "
                             "pass None for no window")
        return Window(window - 1, 0 if causal else window - 1)
    if len(window) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in window):
        raise ValueError(f"window_size must be two ints (left, right), got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window_size={tuple(window)}: each side is >= 0, or -1 for unbounded")
    if causal and right > 0:
        raise ValueError(f"window_size={tuple(window)} looks right of the query, which causal attention "
                         "cannot: pass right=0 (or -1), or causal=False")
    result = Window(None if left == -1 else left, None if right == -1 else right)
    return None if result.left is None and (causal or result.right is None) else result


def flash_window(window: Window | None, causal: bool) -> tuple[int, int]:
    """flash-attn's ``window_size`` of ``window`` (-1: unbounded; causal: right 0)."""
    if window is None:
        return (-1, 0 if causal else -1)
    left = -1 if window.left is None else window.left
    right = 0 if causal else (-1 if window.right is None else window.right)
    return left, right


def halo_is_cheaper(segments: list[list[list[Segment]]]) -> bool:
    """Whether sending each rank the rows it uses straight from their owners (a halo exchange: the all-gather
    plan's all-to-all) moves fewer K/V rows in all than the one-way ring, which relays a block through every
    rank between its owner and its last user (a sliding window on zigzag-like layouts: the right neighbour's
    keys come last). ``segments`` are every rank pair's (``rank_plan.pair_segments``); the same on every rank."""
    world = len(segments)

    def used(q: int, source: int) -> list[Interval]:
        return union([seg.kv for seg in segments[q][source]])

    halo = sum(size(used(q, s)) for q in range(world) for s in range(world) if q != s)
    ring = sum(size(union([i for later in range(hop, world) for i in used((s + later) % world, s)]))
               for s in range(world) for hop in range(1, world))
    return halo < ring


def kv_rows_received(plan, local_len: int) -> int:  # noqa: ANN001 - a CPPlan (batch_plan imports this module)
    """K/V rows this CP rank receives in one attention forward of ``plan`` (of one sample, or of the folded
    batch when the plan is packed; ``local_len`` rows per rank and sample): its algorithm's count
    (``CPAlgorithm.kv_rows_received``); 0 without CP."""
    if plan is None or len(plan.areas) == 1:
        return 0
    return plan.algorithm.kv_rows_received(plan, local_len)


def kv_bytes_received(plan, batch: int, local_len: int, kv_heads: int, head_dim: int,  # noqa: ANN001
                      dtype: torch.dtype) -> int:
    """Bytes of K and V this CP rank receives per layer forward under ``plan`` (a ``CPPlan``; the trainer's
    metrics of a window layer): ``kv_rows_received`` for ``batch`` samples (once for a packed plan) of
    ``kv_heads`` heads of ``head_dim`` in ``dtype`` (Ulysses and hybrid: the rank's share of the heads). The
    backward receives K/V again and sends dK/dV (fp32) back."""
    rows = kv_rows_received(plan, local_len) * (1 if plan is None or plan.packed else batch)
    share = 1 if plan is None else plan.algorithm.kv_head_share(plan)
    heads = max(1, kv_heads // share)
    return 2 * rows * heads * head_dim * torch.empty((), dtype=dtype).element_size()
