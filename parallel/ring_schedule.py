"""Which part of a ring step each CP rank computes, per layout (pure functions).

At ring step ``s`` rank ``r`` holds the K/V block that started on rank
``source = (r - s) % world``. ``block_task`` says which local query rows meet
which rows of that K/V block, and whether the mask inside is causal; ``None``
means the block is fully masked and is skipped. ``n`` is the local length.

Causal rules (non-causal: every step is all rows against all rows):

- contiguous: step 0 causal; lower source: everything; higher source: skipped.
- zigzag (rank r holds chunks r and 2w-1-r): step 0 causal; lower source: all
  queries against the first half of the K/V; higher source: the second half of
  the queries against all K/V. Every step is one kernel call, no masked work.
- stripe (token t on rank t % w, local i is global i*w + r): step 0 causal;
  lower source: causal (key m visible when m <= i); higher source: m < i,
  i.e. queries 1..n-1 against keys 0..n-2, causal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockTask:
    """Local query rows ``q_rows`` attend to rows ``kv_rows`` of the held K/V block."""

    q_rows: slice
    kv_rows: slice
    causal: bool


def block_task(layout: str, causal: bool, rank: int, source: int, n: int) -> BlockTask | None:
    """The kernel call rank ``rank`` makes on the K/V block from ``source`` (None: skip)."""
    every = slice(0, n)
    if not causal:
        return BlockTask(every, every, False)
    if source == rank:
        return BlockTask(every, every, True)
    lower = source < rank
    if layout == "contiguous":
        return BlockTask(every, every, False) if lower else None
    if layout == "zigzag":
        half = n // 2
        return BlockTask(every, slice(0, half), False) if lower else BlockTask(slice(half, n), every, False)
    if layout == "stripe":
        if lower:
            return BlockTask(every, every, True)
        return BlockTask(slice(1, n), slice(0, n - 1), True) if n > 1 else None
    raise ValueError(f"unknown CP layout {layout!r}")


def expected_kernel_calls(layout: str, causal: bool, rank: int, world: int, n: int) -> int:
    """Kernel calls one rank makes per head chunk for one forward (the backward makes as many)."""
    return sum(block_task(layout, causal, rank, (rank - s) % world, n) is not None for s in range(world))


def covered_kv_rows(layout: str, causal: bool, source: int, hops: int, world: int, n: int) -> int:
    """Rows ``[0, stop)`` of ``source``'s K/V block that the ``hops`` ranks after it have used.

    The travelling dK/dV accumulator of that block carries exactly these rows. Every
    rule above uses a prefix of the K/V rows, which is what makes the union a prefix.
    """
    stop = 0
    for hop in range(1, hops + 1):
        task = block_task(layout, causal, (source + hop) % world, source, n)
        if task is not None:
            stop = max(stop, task.kv_rows.stop)
    return stop


def needed_kv_rows(layout: str, causal: bool, source: int, from_hop: int, world: int, n: int) -> int:
    """Rows ``[0, stop)`` of ``source``'s K/V block that hops ``from_hop .. world-1`` still use.

    A K/V transfer carries only these rows (0: the transfer is skipped).
    """
    stop = 0
    for hop in range(from_hop, world):
        task = block_task(layout, causal, (source + hop) % world, source, n)
        if task is not None:
            stop = max(stop, task.kv_rows.stop)
    return stop
