"""The attention mask between two CP ranks' tokens as a few kernel-sized segments (pure functions).

A token attends to the tokens of its own document that come earlier-or-equal (causal) or to its
whole document (not causal), within a sliding ``Window`` when one is given (``(left, right)`` keys either
side of the query, None unbounded). Each rank's tokens are given by ``keys``: one int64 per token,
``(document, position)`` packed so that the order of keys is the order along the sequence; every
rank holds its tokens in increasing key order (true of every CP layout here). A query's visible keys
in another rank's block are then one interval of that block's rows, found by binary search, and the
query rows cut into *runs*: consecutive rows seeing the same interval (a full rectangle), an interval
growing by one key per row (a causal rectangle, aligned bottom-right), one sliding by one key per row (a
band) or one shrinking from the left by one key per row (an inverted triangle). Rows that see nothing are
in no run. Intervals of rows are ``(start, stop)`` pairs; row sets are sorted lists of disjoint intervals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

Interval = tuple[int, int]
NONE, FLAT, DIAG, SLIDE, SHRINK = 0, 1, 2, 3, 4
STEPS = {FLAT: (0, 0), DIAG: (0, 1), SLIDE: (1, 1), SHRINK: (1, 0)}  # (start, stop) change from row to row


class Window(NamedTuple):
    """Keys visible around a query at position ``i`` of its document: ``i - left ... i + right`` (None:
    unbounded; a causal mask stops at ``i`` whatever ``right`` says). HF's ``sliding_window = W`` is
    ``Window(W - 1, 0)``."""

    left: int | None
    right: int | None


@dataclass(frozen=True)
class Segment:
    """Query rows ``q`` attend to rows ``kv`` of a K/V block. Query row ``q[0] + t`` sees keys from ``t``
    (``slide``) or 0 up to the first ``len(kv) - len(q) + t + 1`` (``causal``: bottom-right aligned,
    ``len(kv) >= len(q)``) or all keys. ``causal`` and ``slide``: a band; ``slide`` alone: an inverted triangle."""

    q: Interval
    kv: Interval
    causal: bool
    slide: bool = False

    @property
    def rows(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def keys(self) -> int:
        return self.kv[1] - self.kv[0]

    @property
    def area(self) -> int:
        """Query-key pairs computed."""
        rows, keys = self.rows, self.keys
        area = rows * keys
        if self.causal:
            area -= rows * (rows - 1) // 2
        if self.slide:
            area -= rows * (rows - 1) // 2
        return area

    def dense_calls(self) -> list[Segment]:
        """The same pairs as calls of a dense kernel whose masks are square: full rectangles, causal squares
        and inverted-triangle squares (``slide`` without ``causal``; ``band.py``)."""
        if self.slide:
            return _sliding_calls(self)
        if not self.causal or self.keys == self.rows:
            return [self]
        split = self.kv[1] - self.rows
        return [Segment(self.q, (self.kv[0], split), False), Segment(self.q, (split, self.kv[1]), True)]


def _sliding_calls(segment: Segment) -> list[Segment]:
    """A band or an inverted triangle as full rectangles, causal squares and inverted squares (``slide`` alone,
    square: row ``t`` sees keys ``t...``; the ring runs it as a causal call on rows and keys reversed).

    An inverted triangle wider than tall is an inverted square plus a full rectangle. A band of width ``w``
    (row ``t`` sees keys ``t .. t + w - 1``) goes ``w`` rows at a time: an inverted square on the block's first
    keys, then a causal part on the next ``w - 1`` keys (its first row sees none of them)."""
    (q0, q1), (k0, k1) = segment.q, segment.kv
    rows, keys = q1 - q0, k1 - k0
    if not segment.causal:
        calls = [Segment((q0, q1), (k0, k0 + rows), False, True)]
        return calls + ([Segment((q0, q1), (k0 + rows, k1), False)] if keys > rows else [])
    width = keys - rows + 1
    calls = []
    for at in range(0, rows, width):
        block = min(width, rows - at)
        lo = k0 + at
        calls.append(Segment((q0 + at, q0 + at + block), (lo, lo + block), False, True))
        rest = (lo + block, lo + block + width - 1)
        if width - 1 >= block:
            calls.extend(Segment((q0 + at, q0 + at + block), rest, True).dense_calls())
        elif width > 1:  # block == width: its first row sees none of the rest
            calls.append(Segment((q0 + at + 1, q0 + at + block), rest, True))
    return calls


def pack_keys(documents: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int64 keys ordering tokens by (document, position), the key stride per document ``span``):
    ``documents`` are dense numbers >= 0, ``positions`` >= 0."""
    span = int(positions.max()) + 2 if positions.numel() else 2
    return documents.to(torch.int64) * span + positions.to(torch.int64) + 1, span


def visible_intervals(q_keys: torch.Tensor, q_docs: torch.Tensor, kv_keys: torch.Tensor, span: int,
                      causal: bool, window: Window | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query key, the rows ``[start, stop)`` of the sorted ``kv_keys`` it may see (int64 CPU tensors).

    ``q_docs`` are the queries' documents and ``span`` the key stride per document (``pack_keys``);
    ``window`` bounds the keys around each query (positions within a document are consecutive integers). The
    queries come in increasing key order, which NumPy's binary search exploits (2-3x torch's on the CPU).
    """
    kv, keys = kv_keys.numpy(), q_keys.numpy()
    first = q_docs.numpy().astype(np.int64) * span
    last = keys if causal else first + (span - 1)
    if window is not None and window.left is not None:
        first = np.maximum(first, keys - window.left)
    if window is not None and window.right is not None and not causal:
        last = np.minimum(last, keys + window.right)
    start = np.searchsorted(kv, first, side="left")
    stop = np.searchsorted(kv, last, side="right")
    return torch.from_numpy(start), torch.from_numpy(stop)


def runs(start: torch.Tensor, stop: torch.Tensor) -> list[Segment]:
    """Cut query rows into runs (see the module docstring) and return one ``Segment`` per run."""
    start_np, stop_np = start.numpy(), stop.numpy()
    return [Segment((first, last + 1), (int(start_np[first]), int(stop_np[last])),
                    kind in (DIAG, SLIDE) and last > first, kind in (SLIDE, SHRINK) and last > first)
            for first, last, kind in _run_rows(start_np, stop_np).tolist()]


def dense_call_count(start: torch.Tensor, stop: torch.Tensor) -> int:
    """``sum(len(s.dense_calls()) for s in runs(start, stop))`` without building the segments: a row alone or a
    full rectangle is one call, a causal rectangle wider than tall two; only bands and inverted triangles (few)
    are cut one by one. Layouts that interleave ranks (stripe) against a gathered sequence make one run per row."""
    start_np, stop_np = start.numpy(), stop.numpy()
    first, last, kind = _run_rows(start_np, stop_np).T
    several = last > first
    causal = several & ((kind == DIAG) | (kind == SLIDE))
    slide = several & ((kind == SLIDE) | (kind == SHRINK))
    wide = causal & ~slide & (stop_np[last] - start_np[first] != last - first + 1)
    count = int((~slide).sum() + wide.sum())
    for i in np.flatnonzero(slide).tolist():
        segment = Segment((int(first[i]), int(last[i]) + 1), (int(start_np[first[i]]), int(stop_np[last[i]])),
                          bool(causal[i]), True)
        count += len(segment.dense_calls())
    return count


def _run_rows(start_np: np.ndarray, stop_np: np.ndarray) -> np.ndarray:
    """The runs as ``[runs, 3]`` int64 rows ``(first row, last row, kind)``, in row order.

    ``link[j]`` says how row j+1 continues row j (same interval, one key more, or neither); the loop
    visits stretches of equal links, not rows, so its cost follows the number of stretches (rows that stand
    alone come as one array per stretch).
    """
    valid = stop_np > start_np
    if not valid.any():
        return np.zeros((0, 3), dtype=np.int64)
    both = valid[1:] & valid[:-1]
    d_start, d_stop = start_np[1:] - start_np[:-1], stop_np[1:] - stop_np[:-1]
    link = np.full(len(both), NONE, dtype=np.int64)
    for kind, (a, b) in STEPS.items():
        link[both & (d_start == a) & (d_stop == b)] = kind
    found: list[np.ndarray] = []  # closed runs, in row order
    current = (0, 0, NONE) if valid[0] else None  # the run holding the last row visited
    edges = np.flatnonzero(np.diff(link)) + 1
    for lo, hi in zip(np.concatenate(([0], edges)).tolist(), np.concatenate((edges, [len(link)])).tolist(),
                      strict=True):
        if hi == lo:  # links lo..hi-1 join rows lo..hi
            continue
        kind = int(link[lo])
        if kind == NONE:  # rows lo+1..hi each stand alone
            if current is not None:
                found.append(np.array([current], dtype=np.int64))
            alone = np.flatnonzero(valid[lo + 1: hi + 1]) + lo + 1
            current = (hi, hi, NONE) if len(alone) and alone[-1] == hi else None
            if current is not None:
                alone = alone[:-1]
            if len(alone):
                found.append(np.stack([alone, alone, np.full_like(alone, NONE)], axis=1))
        elif current is not None and current[2] in (NONE, kind):
            current = (current[0], hi, kind)
        else:
            if current is not None:
                found.append(np.array([current], dtype=np.int64))
            current = (lo + 1, hi, kind if hi > lo + 1 else NONE)
    if current is not None:
        found.append(np.array([current], dtype=np.int64))
    return np.concatenate(found) if found else np.zeros((0, 3), dtype=np.int64)


def window_pairs(rows: int, causal: bool, window: Window | None = None) -> int:
    """Query-key pairs of one document of ``rows`` tokens under ``causal`` and ``window``."""
    if window is None or (window.left is None and (causal or window.right is None)):
        return rows * (rows + 1) // 2 if causal else rows * rows
    i = torch.arange(rows)
    lo = i - window.left if window.left is not None else torch.zeros_like(i)
    hi = i if causal else (i + window.right if window.right is not None else torch.full_like(i, rows - 1))
    return int((hi.clamp(max=rows - 1) - lo.clamp(min=0) + 1).sum())


def union(intervals: list[Interval]) -> list[Interval]:
    """The sorted, disjoint, non-empty intervals covering ``intervals``."""
    merged: list[list[int]] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def size(rows: list[Interval]) -> int:
    return sum(hi - lo for lo, hi in rows)


def locate(rows: list[Interval], part: Interval) -> Interval:
    """Where ``part`` (inside one interval of ``rows``) lies in the compacted storage of ``rows``."""
    offset = 0
    for lo, hi in rows:
        if lo <= part[0] and part[1] <= hi:
            begin = offset + part[0] - lo
            return begin, begin + part[1] - part[0]
        offset += hi - lo
    raise ValueError(f"rows {part} are not stored in {rows}")


def selector(rows: list[Interval], within: list[Interval]) -> slice | torch.Tensor:
    """Pick the compacted ``rows`` out of the compacted ``within`` (a superset): a slice when they form
    one stretch of it, else an index tensor."""
    located = [locate(within, part) for part in rows]
    if not located:
        return slice(0, 0)
    if all(located[i][1] == located[i + 1][0] for i in range(len(located) - 1)):
        return slice(located[0][0], located[-1][1])
    return torch.cat([torch.arange(lo, hi) for lo, hi in located])
