"""Ulysses with packed documents: which documents stay home, and the plans of what still travels.

A document whose tokens all lie on one CP rank needs nothing from the others: that rank attends it
locally with all its heads (its *home* rows). Only the other documents' rows (the *cross* rows) go
through Ulysses' all-to-all, so the bytes follow the documents that span ranks, not the sequence.

Balance: a home document's work stays on its rank, while the cross work is spread evenly by heads,
so rank ``r`` computes ``home_r + cross / u``: the ranks differ only by their home work, and the busiest
must stay within ``TOLERANCE`` of the mean. ``home_documents`` tries two choices and keeps the one that
fits with the most rows home: every whole document home, then the busiest rank's documents travelling
one at a time while that lowers the peak; and every rank keeping its least-work documents up to a common
cap (a cap of 0, every document travelling, is exactly balanced, so some choice always fits). All of it
is integer arithmetic on every rank's tokens, so every rank reaches the same choice.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cp_train.parallel.cp.plan.device import Apply, Selector, apply_rows
from cp_train.parallel.cp.plan.rank_plan import RankPlan, StepPlan
from cp_train.parallel.cp.plan.routing import route_by_documents
from cp_train.parallel.cp.plan.segments import Window, runs, visible_intervals, window_pairs

TOLERANCE = (102, 100)  # the busiest rank's work may exceed the mean by 2%


@dataclass(frozen=True)
class UlyssesDocuments:
    """One rank's Ulysses-with-documents plan (rows are the plan's rows: per sample, or the folded batch).

    ``home``: a one-step plan of this rank's home queries against its own rows (None: no home rows);
    ``cross``: this rank's cross rows, in order; ``counts``: every rank's number of cross rows; ``blocks``:
    per rank ``i``, a plan of its cross queries against every rank's cross rows where they land (step
    ``t`` holds rank ``(i - t) % u``'s, step 0 the block's own, which every query row sees)."""

    home: RankPlan | None
    cross: Selector
    counts: tuple[int, ...]
    blocks: tuple[RankPlan, ...]

    def apply(self, fn: Apply, device: torch.device, varlen: bool) -> UlyssesDocuments:
        """These plans with ``fn`` applied to every index tensor (``RankPlan.apply``)."""
        home = None if self.home is None else self.home.apply(fn, device, varlen)
        return UlyssesDocuments(home, apply_rows(self.cross, fn), self.counts,
                                tuple(block.apply(fn, device, varlen) for block in self.blocks))


def document_work(rows: int, causal: bool, window: Window | None = None) -> int:
    """Query-key pairs of one document of ``rows`` tokens."""
    return window_pairs(rows, causal, window)


Choice = dict[int, int]  # document -> the rank that attends it at home


def home_documents(docs: torch.Tensor, causal: bool, window: Window | None = None) -> Choice:
    """``{document: its rank}`` for the documents attended at home, from every rank's dense document numbers
    ``docs`` ``[world, rows]``: only documents wholly on one rank, chosen as the module docstring says."""
    world = docs.shape[0]
    numbers, counts = torch.unique(docs, return_counts=True)
    rows = dict(zip(numbers.tolist(), counts.tolist(), strict=True))
    work = {d: document_work(n, causal, window) for d, n in rows.items()}
    held = [set(torch.unique(docs[rank]).tolist()) for rank in range(world)]
    whole = []  # per rank: its whole documents, least work first
    for rank in range(world):
        elsewhere = set().union(*(held[r] for r in range(world) if r != rank))
        whole.append(sorted(held[rank] - elsewhere, key=lambda d: (work[d], d)))
    total = sum(work.values())

    def fits(home: list[int]) -> bool:  # each rank's home work -> the busiest rank within the tolerance
        return (world * max(home) + total - sum(home)) * TOLERANCE[1] <= total * TOLERANCE[0]

    choices = [_capped(whole, work, rows, fits), _levelled(whole, work, total, fits)]
    return max((c for c in choices if fits(_home_work(c, work, world))), key=lambda c: sum(rows[d] for d in c))


def _home_work(choice: Choice, work: dict[int, int], world: int) -> list[int]:
    home = [0] * world
    for d, rank in choice.items():
        home[rank] += work[d]
    return home


def _capped(whole: list[list[int]], work: dict[int, int], rows: dict[int, int],
            fits: Callable[[list[int]], bool]) -> Choice:
    """Every rank keeps its least-work documents up to a common cap on its home work: the cap that fits and
    keeps the most rows (a cap of 0 always fits)."""
    prefix = [list(itertools.accumulate((work[d] for d in docs), initial=0)) for docs in whole]
    row_prefix = [list(itertools.accumulate((rows[d] for d in docs), initial=0)) for docs in whole]
    best, best_rows = (0,) * len(whole), 0
    for cap in sorted({w for sums in prefix for w in sums}, reverse=True):
        kept = tuple(bisect.bisect_right(sums, cap) - 1 for sums in prefix)
        staying = sum(counts[n] for counts, n in zip(row_prefix, kept, strict=True))
        if staying > best_rows and fits([sums[n] for sums, n in zip(prefix, kept, strict=True)]):
            best, best_rows = kept, staying
    return {d: rank for rank, (docs, n) in enumerate(zip(whole, best, strict=True)) for d in docs[:n]}


def _levelled(whole: list[list[int]], work: dict[int, int], total: int,
              fits: Callable[[list[int]], bool]) -> Choice:
    """Every whole document home; then, while that does not fit, the document of the busiest rank whose move
    to the cross rows lowers the peak most travels (it stops where no single move lowers it)."""
    world = len(whole)
    choice = {d: rank for rank, docs in enumerate(whole) for d in docs}
    home = _home_work(choice, work, world)
    while not fits(home):
        rank = max(range(world), key=lambda r: (home[r], -r))
        others = max((home[r] for r in range(world) if r != rank), default=0)
        peak = world * max(home) + total - sum(home)
        moves = [(world * max(others, home[rank] - work[d]) + total - sum(home) + work[d], d)
                 for d in whole[rank] if d in choice]
        best = min(moves, default=None)
        if best is None or best[0] >= peak:
            break
        del choice[best[1]]
        home[rank] -= work[best[1]]
    return choice


def _block_plan(keys: list[torch.Tensor], docs: list[torch.Tensor], span: int, index: int, causal: bool,
                packed: bool, window: Window | None = None) -> RankPlan:
    """Rank ``index``'s cross queries against every rank's cross rows (``keys``/``docs`` per rank)."""
    world = len(keys)
    steps = []
    for step in range(world):
        source = (index - step) % world
        segments = tuple(runs(*visible_intervals(keys[index], docs[index], keys[source], span, causal, window)))
        held = keys[source].numel()
        steps.append(StepPlan(source, segments, tuple(s.kv for s in segments), held, held, None, (0, 0), None,
                              (0, 0)))
    calls = max(len(step.calls) for step in steps)
    rows = keys[index].numel()
    return RankPlan(world, index, rows, packed, route_by_documents(steps, rows, True, window), None, (), calls, True)


def _home_plan(keys: torch.Tensor, docs: torch.Tensor, home: torch.Tensor, span: int, causal: bool,
               packed: bool, window: Window | None = None) -> RankPlan | None:
    """One rank's home queries (``home``: a bool per row) against its own rows, as a one-step plan."""
    if not bool(home.any()):
        return None
    start, stop = visible_intervals(keys, docs, keys, span, causal, window)
    stop = torch.where(home, stop, start)  # cross rows: nothing here
    segments = tuple(runs(start, stop))
    rows = keys.numel()
    step = StepPlan(0, segments, tuple(s.kv for s in segments), rows, rows, None, (0, 0), None, (0, 0))
    return RankPlan(1, 0, rows, packed, route_by_documents([step], rows, True, window), None, (), len(step.calls))


def ulysses_documents_plan(keys: torch.Tensor, docs: torch.Tensor, span: int, rank: int, causal: bool,
                           packed: bool, window: Window | None = None
                           ) -> tuple[UlyssesDocuments, tuple[int, ...], int]:
    """(``rank``'s plan, every rank's work ``home_r + cross // u``, the most kernel calls in any one step of any
    rank: the same on every rank) from every rank's sorted keys and dense documents ``[world, rows]``."""
    world = keys.shape[0]
    home = home_documents(docs, causal, window)
    stays = torch.isin(docs, torch.tensor(sorted(home), dtype=docs.dtype))
    away = [torch.nonzero(~stays[r]).flatten() for r in range(world)]
    cross_keys, cross_docs = [keys[r][away[r]] for r in range(world)], [docs[r][away[r]] for r in range(world)]
    blocks = tuple(_block_plan(cross_keys, cross_docs, span, i, causal, packed, window) for i in range(world))
    homes = [_home_plan(keys[r], docs[r], stays[r], span, causal, packed, window) for r in range(world)]
    loads = [sum(s.area for s in plan.steps[0].segments) if plan else 0 for plan in homes]
    cross = sum(s.area for block in blocks for step in block.steps for s in step.segments)
    calls = max([block.max_calls for block in blocks] + [plan.max_calls for plan in homes if plan])
    plan = UlyssesDocuments(homes[rank], _selector(away[rank]), tuple(int(a.numel()) for a in away), blocks)
    return plan, tuple(load + cross // world for load in loads), calls


def _selector(rows: torch.Tensor) -> Selector:
    """Sorted row numbers as a slice when they are one stretch, else the index tensor itself."""
    if rows.numel() and int(rows[-1]) - int(rows[0]) + 1 == rows.numel():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows if rows.numel() else slice(0, 0)
