"""One CP rank's ring schedule, derived from the attention mask (see ``segments.py``).

At ring step ``t`` rank ``r`` holds the K/V block that started on ``source = (r - t) % world``. The
plan lists, per step, the kernel segments (query rows x rows of the held block), and sizes every
transfer to what is still needed: a K/V hop carries only the rows that later ranks use, and the
travelling dK/dV accumulator only the rows that earlier ranks touched. Held blocks and accumulators
are stored *compacted* (just their rows, in order), and the plan's segments index those stores.

``plan_for_layout`` is the causal or full mask of one document per sample (cached: it depends only on
the layout, the world and the local length). ``plan_for_documents`` builds the mask of packed documents
from every rank's document ids and positions. Rows are those of one sample, applied to every sample
of the batch (``packed=False``), or, when samples differ, the batch folded into one long row
(``packed=True``: tensors are viewed ``[1, B*n, ...]``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.cp.plan.device import CPU, Apply, MovedOnce, Selector, apply_rows, plan_device
from cp_train.parallel.cp.plan.routing import route_by_documents
from cp_train.parallel.cp.plan.segments import (
    Interval,
    Segment,
    Window,
    locate,
    pack_keys,
    runs,
    selector,
    size,
    union,
    visible_intervals,
)
from cp_train.parallel.cp.plan.varlen_plan import VarlenCall, step_varlen


class KernelCall(NamedTuple):
    """One dense kernel call of a step: ``segment`` (query rows x rows of the held K/V store; a causal one is
    square) and ``grad_kv``, the same key rows in the step's dK/dV accumulator."""

    segment: Segment
    grad_kv: Interval


@dataclass(frozen=True)
class StepPlan:
    """Rank ``r``'s work at one ring step on the block from ``source``.

    ``segments``: query rows x rows of the held K/V store (``held_rows`` rows); ``grad_kv``: the same
    segments' rows in the dK/dV accumulator of that block (``acc_rows`` rows; the rank's own dk/dv at
    step 0). ``kv_send`` picks the held rows sent on (``kv_rows`` = (sent, received) row counts);
    ``grad_grow`` places the arriving accumulator in this step's (``grad_rows`` = (rows sent on, rows
    received) after this step).
    """

    source: int
    segments: tuple[Segment, ...]
    grad_kv: tuple[Interval, ...]
    held_rows: int
    acc_rows: int
    kv_send: Selector
    kv_rows: tuple[int, int]
    grad_grow: Selector
    grad_rows: tuple[int, int]
    varlen: tuple[VarlenCall, ...] | None = field(default=None, compare=False)  # one sample's (None: not built)
    by_documents: bool = False  # the calls take their shapes from the documents (``route_by_documents``)

    def apply(self, fn: Apply, varlen: bool) -> StepPlan:
        """This step with ``fn`` applied to its index tensors; ``varlen``: its varlen calls built first (when
        ``by_documents``)."""
        calls = self.varlen
        if calls is None and varlen and self.by_documents:
            calls = step_varlen(self.segments, self.grad_kv)
        return dataclasses.replace(self, kv_send=apply_rows(self.kv_send, fn), grad_grow=apply_rows(self.grad_grow, fn),
                                   varlen=None if calls is None else tuple(call.apply(fn) for call in calls))

    @functools.cached_property
    def calls(self) -> list[KernelCall]:
        """``dense_calls()``, computed once."""
        return self.dense_calls()

    def dense_calls(self) -> list[KernelCall]:
        """The step's segments as calls of a dense kernel (causal calls square), with their accumulator rows."""
        calls = []
        for segment, grad in zip(self.segments, self.grad_kv, strict=True):
            for call in segment.dense_calls():
                offset = grad[0] - segment.kv[0]
                calls.append(KernelCall(call, (call.kv[0] + offset, call.kv[1] + offset)))
        return calls


@dataclass(frozen=True)
class RankPlan(MovedOnce):
    """Everything rank ``rank`` of ``world`` does; ``rows`` per sample (or all samples when ``packed``).
    ``home`` places the accumulator of the rank's own block arriving after the last hop; ``areas`` is
    every rank's mask area (query-key pairs), for the load balance; ``max_calls`` the most dense kernel calls
    any rank makes in one step (the same number on every rank, so choices made from it agree)."""

    world: int
    rank: int
    rows: int
    packed: bool
    steps: tuple[StepPlan, ...]
    home: Selector
    areas: tuple[int, ...]
    max_calls: int
    whole_blocks: bool = False  # gathered plans only (see ``gathered_plan``)
    send_index: torch.Tensor | None = field(default=None, compare=False)  # gathered plans: rows sent by all-to-all
    device: torch.device = field(default=CPU, compare=False)  # where the index tensors are
    cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # per-device index tensors

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' mask areas (1.0: perfectly balanced)."""
        mean = sum(self.areas) / len(self.areas)
        return max(self.areas) / mean if mean else 1.0

    def apply(self, fn: Apply, device: torch.device, varlen: bool) -> RankPlan:
        """This plan with ``fn`` applied to every index tensor (now on ``device``), varlen calls built first when
        ``varlen``; a fresh cache."""
        return dataclasses.replace(self, steps=tuple(step.apply(fn, varlen) for step in self.steps),
                                   home=apply_rows(self.home, fn), send_index=apply_rows(self.send_index, fn),
                                   device=device, cache={})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RankPlan:
        """This plan with every index tensor on ``device`` (the varlen calls of steps of many calls built for a
        GPU first): the one place the plan moves, ahead of the forward. The plan itself where it is already."""
        device = plan_device(device)
        if device == self.device:
            return self
        return self.apply(lambda x: x.to(device, non_blocking=non_blocking), device, device.type != "cpu")

    def pin_memory(self) -> RankPlan:
        """This plan (on the CPU) with its varlen calls built and every index tensor in page-locked memory, so
        ``to(device, non_blocking=True)`` copies without waiting (the data loader calls it with ``pin_memory``)."""
        return self.apply(lambda x: x.pin_memory(), self.device, True)



def pair_segments(keys: torch.Tensor, docs: torch.Tensor, span: int, causal: bool,
              window: Window | None = None) -> list[list[list[Segment]]]:
    """``[q_rank][source]`` -> segments in the source block's own rows."""
    world = keys.shape[0]
    found = []
    for q_rank in range(world):
        row = []
        for source in range(world):
            start, stop = visible_intervals(keys[q_rank], docs[q_rank], keys[source], span, causal, window)
            row.append(runs(start, stop))
        found.append(row)
    return found


def build_plan(keys: torch.Tensor, docs: torch.Tensor, span: int, rank: int, causal: bool,
               packed: bool = False, window: Window | None = None,
               segments: list[list[list[Segment]]] | None = None) -> RankPlan:
    """The plan of ``rank`` from every rank's sorted token keys ``[world, rows]`` (``pack_keys``); ``segments``:
    ``pair_segments``' of the same arguments, when the caller has them."""
    world, rows = keys.shape
    segments = segments if segments is not None else pair_segments(keys, docs, span, causal, window)
    every: list[Interval] = [(0, rows)]

    def used(source: int, hop: int) -> list[Interval]:
        return union([seg.kv for seg in segments[(source + hop) % world][source]])

    def needed(source: int, step: int) -> list[Interval]:  # rows of the block held at ``step``
        if step == 0:
            return every
        return union([i for hop in range(step, world) for i in used(source, hop)])

    def covered(source: int, step: int) -> list[Interval]:  # rows of the accumulator after ``step``
        return union([i for hop in range(1, step + 1) for i in used(source, hop)])

    steps = []
    for step in range(world):
        source, arriving = (rank - step) % world, (rank - step - 1) % world
        held = needed(source, step)
        mine = segments[rank][source]
        accumulator = every if step == 0 else covered(source, step)
        last = step + 1 == world
        onward = [] if last else needed(source, step + 1)
        steps.append(StepPlan(
            source=source,
            segments=tuple(dataclasses.replace(s, kv=locate(held, s.kv)) for s in mine),
            grad_kv=tuple(locate(accumulator, s.kv) for s in mine),
            held_rows=size(held), acc_rows=size(accumulator),
            kv_send=selector(onward, held) if onward else None,
            kv_rows=(size(onward), 0 if last else size(needed(arriving, step + 1))),
            grad_grow=selector(covered(source, step - 1), accumulator) if step > 1 and covered(source, step - 1)
            else None,
            grad_rows=(0, 0) if step == 0 else (size(accumulator), size(covered(arriving, step)))))
    home_rows = covered(rank, world - 1) if world > 1 else []
    areas = tuple(sum(seg.area for source in range(world) for seg in segments[q][source]) for q in range(world))
    max_calls = max(sum(len(seg.dense_calls()) for seg in pair) for row in segments for pair in row)
    return RankPlan(world, rank, rows, packed, route_by_documents(steps, rows, bool(docs.any()), window),
                    selector(home_rows, every) if home_rows else None, areas, max_calls)


def gathered_plan(keys: torch.Tensor, docs: torch.Tensor, span: int, rank: int, causal: bool, packed: bool,
                  areas: tuple[int, ...], max_calls: int, window: Window | None = None,
                  segments: list[list[list[Segment]]] | None = None) -> RankPlan:
    """All-gather's plan: ``rank``'s queries against every rank's block, nothing travelling on. Step ``t``
    attends the block of rank ``(rank - t) % world`` (step 0 the rank's own, which every query row sees).

    ``whole_blocks`` (the same on every rank): every step holds its whole block, because every rank uses
    every row of every other block; segments index each block's own rows. Otherwise (packed documents)
    only the rows used travel: step ``t`` holds the rows of its block that this rank's queries use
    (compacted, like the ring's stores) and ``kv_send`` picks the rows of this rank's block that rank
    ``(rank + t) % world`` uses (``kv_rows`` = (sent, received)). ``areas`` and ``max_calls`` are given,
    the same on every rank."""
    world, rows = keys.shape
    every: list[Interval] = [(0, rows)]
    segments = segments if segments is not None else pair_segments(keys, docs, span, causal, window)
    used = [[union([seg.kv for seg in segments[q][source]]) for source in range(world)] for q in range(world)]
    whole = all(used[q][s] == every for q in range(world) for s in range(world) if q != s)
    steps = []
    for step in range(world):
        source, destination = (rank - step) % world, (rank + step) % world
        held = every if step == 0 or whole else used[rank][source]
        sent = every if whole else used[destination][rank]
        compact = tuple(dataclasses.replace(seg, kv=locate(held, seg.kv)) for seg in segments[rank][source])
        steps.append(StepPlan(source=source, segments=compact, grad_kv=tuple(seg.kv for seg in compact),
                              held_rows=size(held), acc_rows=size(held),
                              kv_send=selector(sent, every) if step and sent else None,
                              kv_rows=(size(sent), size(held)) if step else (0, 0), grad_grow=None,
                              grad_rows=(0, 0)))
    index = None if whole else _send_index(steps, rank, world)
    return RankPlan(world, rank, rows, packed, route_by_documents(steps, rows, bool(docs.any()), window), None, areas,
                    max_calls, whole, index)


def _send_index(steps: list[StepPlan], rank: int, world: int) -> torch.Tensor:
    """The rows of ``rank``'s block its all-to-all sends, destination rank after destination rank (as
    ``all_to_all_single`` cuts its input): step ``t`` sends to rank ``(rank + t) % world``."""
    parts = []
    for destination in range(world):
        step = steps[(destination - rank) % world]
        if destination != rank and step.kv_rows[0]:
            rows = step.kv_send
            parts.append(torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@functools.cache
def plan_for_layout(layout: str, causal: bool, world: int, rank: int, rows: int,
                    window: Window | None = None) -> RankPlan:
    """One document per sample in ``layout``: ``rows`` local tokens per rank."""
    positions = torch.stack([sequence_positions(rows * world, r, world, layout) for r in range(world)])
    docs = torch.zeros_like(positions)
    keys, span = pack_keys(docs, positions)
    return build_plan(keys, docs, span, rank, causal, window=window)


def plan_for_documents(docs: torch.Tensor, positions: torch.Tensor, rank: int, causal: bool,
                       window: Window | None = None) -> RankPlan:
    """The plan for packed documents: ``docs`` and ``positions`` ``[world, batch, n]`` (every rank's, CPU int64),
    documents non-decreasing along each sample, positions increasing within a document, each rank's tokens
    in sequence order. Raises ``ValueError`` saying what is wrong otherwise."""
    world, batch, rows = docs.shape
    ranked = torch.empty_like(docs)
    for b in range(batch):  # dense document numbers per sample, in sequence order
        ranked[:, b] = torch.unique(docs[:, b], return_inverse=True)[1]
    uniform = all(torch.equal(ranked[:, b], ranked[:, 0]) and torch.equal(positions[:, b], positions[:, 0])
                  for b in range(1, batch))
    if uniform:
        ranked, positions = ranked[:, 0], positions[:, 0]
    else:  # fold the batch into one row: documents of different samples never meet
        offsets = (torch.arange(batch) * (int(ranked.max()) + 1)).view(1, batch, 1)
        ranked, positions = (ranked + offsets).reshape(world, -1), positions.reshape(world, -1)
    keys, span = pack_keys(ranked, positions)
    if (keys[:, 1:] <= keys[:, :-1]).any():
        raise ValueError("document_ids must be non-decreasing along each sample, and positions increasing within a "
                         "document, in every CP rank's token order; check the document ids and the CP layout")
    return build_plan(keys, ranked, span, rank, causal, packed=not uniform, window=window)
