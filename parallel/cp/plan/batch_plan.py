"""Per-batch plans: the mask as kernel segments and the token orders a CP algorithm needs.

``plan_batch`` gathers every CP rank's documents and positions once per batch (nothing for one document per
sample in a static layout: that plan is cached) and returns the ``CPPlan`` the algorithm makes of them
(``CPAlgorithm.plan``, ``cp_train.parallel.cp.algorithms``) from the primitives here: ``ring_rank_plan`` (the
ring plan over the CP group, ``rank_plan.py``; with a sliding window where sending each rank the rows it uses
from their owners moves fewer rows than relaying them, the all-gather plan's halo exchange), ``rank_order``
(Ulysses' rows in sequence order) and ``work``. At one rank every algorithm is the local kernel: the ring plan
of that rank.

``order`` indexes rows gathered rank after rank, per sample ``[1 or B, rows]``, or the folded
``[1, B*rows]`` when the plan is packed (samples differ). ``areas`` are every CP rank's query-key pairs
(per head: Ulysses ranks count their share of the heads). ``window`` (``segments.Window``) bounds every mask.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from cp_train.parallel.cp.algorithms.registry import CPAlgorithm, get_cp_algorithm
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, sequence_positions
from cp_train.parallel.cp.plan.device import CPU, Apply, MovedOnce, plan_device
from cp_train.parallel.cp.plan.documents import gather_mask_inputs
from cp_train.parallel.cp.plan.rank_plan import RankPlan, build_plan, gathered_plan, pair_segments
from cp_train.parallel.cp.plan.segments import Window, dense_call_count, pack_keys, visible_intervals, window_pairs
from cp_train.parallel.cp.plan.ulysses_plan import UlyssesDocuments
from cp_train.parallel.cp.plan.window_plan import halo_is_cheaper
from cp_train.parallel.mesh.model_parallel import CPGroups


@dataclass(frozen=True)
class CPPlan(MovedOnce):
    """One batch's plan for ``algorithm`` (a ``CPAlgorithm``; see the module docstring)."""

    algorithm: CPAlgorithm
    ring: RankPlan | None
    order: torch.Tensor | None
    packed: bool
    areas: tuple[int, ...]
    max_calls: int = 1  # the most dense kernel calls any rank makes in one step (the same on every rank)
    documents: UlyssesDocuments | None = None  # ulysses with documents: home rows and the cross blocks
    pairs: int = 0  # visible query-key pairs (per head) of the whole micro-batch, every sample and CP rank
    inverse: torch.Tensor | None = field(default=None, compare=False)  # ``order``'s inverse permutation, flat
    window: Window | None = None  # the sliding window every mask of the plan has (None: unbounded)
    halo: bool = False  # ring: ``ring`` is the all-gather plan of a halo exchange (``window_plan``)
    device: torch.device = field(default=CPU, compare=False)  # where every index tensor is
    cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # a moved copy (``on_device``)

    @property
    def imbalance(self) -> float:
        mean = sum(self.areas) / len(self.areas)
        return max(self.areas) / mean if mean else 1.0

    def _apply(self, fn: Apply, device: torch.device, varlen: bool) -> CPPlan:
        def each(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else fn(x)

        return dataclasses.replace(
            self, ring=None if self.ring is None else self.ring.apply(fn, device, varlen), order=each(self.order),
            inverse=each(self.inverse),
            documents=None if self.documents is None else self.documents.apply(fn, device, varlen),
            device=device, cache={})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CPPlan:
        """This plan with every index tensor (the ring's selectors and varlen calls, the all-gather's routes,
        Ulysses' order and cross rows) on ``device``: the one place a plan moves, ahead of the forward (the
        trainer moves each micro-batch's with ``non_blocking=True``), so the attention copies nothing from
        the host. The plan itself where it is already (on the CPU nothing moves)."""
        device = plan_device(device)
        if device == self.device:
            return self
        return self._apply(lambda x: x.to(device, non_blocking=non_blocking), device, device.type != "cpu")

    def pin_memory(self) -> CPPlan:
        """This plan with its GPU varlen calls built and every index tensor in page-locked memory (called by
        the data loader with ``pin_memory``), so that ``to(device, non_blocking=True)`` does not wait."""
        return self._apply(lambda x: x.pin_memory(), self.device, True)



@dataclass(frozen=True)
class Tokens:
    """Every rank's tokens ``[world, rows]`` as sortable keys (folded over the batch when ``packed``)."""

    keys: torch.Tensor
    docs: torch.Tensor
    span: int
    packed: bool
    batch: int


def tokens_of(docs: torch.Tensor, positions: torch.Tensor) -> Tokens:
    """Keys of ``docs``/``positions`` ``[world, B, n]``: documents numbered densely per sample; the batch kept
    as one sample when every sample has the same documents and positions, else folded into one row."""
    world, batch, n = docs.shape
    ranked = torch.empty_like(docs)
    for b in range(batch):
        ranked[:, b] = torch.unique(docs[:, b], return_inverse=True)[1]
    uniform = all(torch.equal(ranked[:, b], ranked[:, 0]) and torch.equal(positions[:, b], positions[:, 0])
                  for b in range(1, batch))
    if uniform:
        ranked, positions = ranked[:, 0], positions[:, 0]
    else:
        offsets = (torch.arange(batch) * (int(ranked.max()) + 1)).view(1, batch, 1)
        ranked, positions = (ranked + offsets).reshape(world, -1), positions.reshape(world, -1)
    keys, span = pack_keys(ranked, positions)
    return Tokens(keys, ranked, span, not uniform, batch)


def check_sorted(keys: torch.Tensor) -> None:
    if (keys[:, 1:] <= keys[:, :-1]).any():
        raise ValueError("document_ids must be non-decreasing along each sample, and positions increasing within a "
                         "document, in every CP rank's token order; check the document ids and the CP layout")


def gathered_rows(x: torch.Tensor, tokens: Tokens, ranks: range) -> torch.Tensor:
    """``x`` ``[world, rows]`` of ``ranks`` in the order an all-gather / all-to-all delivers them: per sample,
    rank after rank (``[1, len(ranks) * rows]``, sample-major when packed)."""
    part = x[ranks.start:ranks.stop]
    if not tokens.packed:
        return part.reshape(1, -1)
    return part.view(len(ranks), tokens.batch, -1).transpose(0, 1).reshape(1, -1)


def work(tokens: Tokens, everyone: torch.Tensor, causal: bool,
         window: Window | None = None) -> tuple[tuple[int, ...], int]:
    """Each rank's query-key pairs against the sorted keys of ``everyone``, and the most dense kernel calls
    any rank makes for them."""
    areas, calls = [], 0
    for rank in range(tokens.keys.shape[0]):
        start, stop = visible_intervals(tokens.keys[rank], tokens.docs[rank], everyone, tokens.span, causal,
                                        window)
        areas.append(int((stop - start).clamp_min(0).sum()))
        calls = max(calls, dense_call_count(start, stop))
    return tuple(areas), calls


def ring_rank_plan(tokens: Tokens, rank: int, causal: bool, window: Window | None = None) -> tuple[RankPlan, bool]:
    """``(rank's ring plan, halo)``: the ring over every rank of ``tokens``; with a ``window`` where a halo
    exchange moves fewer rows (``window_plan.halo_is_cheaper``), the all-gather plan of the rows each rank uses
    (``halo`` True)."""
    check_sorted(tokens.keys)
    keys, docs, span, packed = tokens.keys, tokens.docs, tokens.span, tokens.packed
    segments = pair_segments(keys, docs, span, causal, window)
    ring = build_plan(keys, docs, span, rank, causal, packed, window, segments)
    halo = window is not None and keys.shape[0] > 2 and halo_is_cheaper(segments)
    if halo:
        ring = gathered_plan(keys, docs, span, rank, causal, packed, ring.areas, ring.max_calls, window, segments)
    return ring, halo


def rank_order(tokens: Tokens, ranks: range) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(order, inverse)`` of the rows of ``ranks`` gathered rank after rank into sequence order, and back
    (None, None: already in order)."""
    order = torch.argsort(gathered_rows(tokens.keys, tokens, ranks), dim=1)
    if torch.equal(order, torch.arange(order.shape[1]).expand_as(order)):
        return None, None
    return order, _inverse(order)


def local_plan(algorithm: CPAlgorithm, tokens: Tokens, causal: bool, window: Window | None = None) -> CPPlan:
    """One rank's plan, whatever ``algorithm``: the local kernel's calls (the ring plan of one rank)."""
    ring, _ = ring_rank_plan(tokens, 0, causal, window)
    return CPPlan(algorithm, ring, None, tokens.packed, ring.areas, ring.max_calls, window=window)


def _plan(algorithm: CPAlgorithm, tokens: Tokens, rank: int, ulysses: int, causal: bool,
          window: Window | None = None) -> CPPlan:
    if tokens.keys.shape[0] == 1:
        return local_plan(algorithm, tokens, causal, window)
    return algorithm.plan(tokens, rank, ulysses, causal, window)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``order`` (flattened): sequence order -> rank order."""
    flat = order.flatten()
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(flat.numel())
    return inverse


@functools.cache
def _static_plan(algorithm: str | CPAlgorithm, layout: str, causal: bool, world: int, ulysses: int, rank: int, n: int,
                 window: Window | None = None) -> CPPlan:
    algorithm = get_cp_algorithm(algorithm)
    positions = torch.stack([sequence_positions(n * world, r, world, layout) for r in range(world)])[:, None]
    plan = _plan(algorithm, tokens_of(torch.zeros_like(positions), positions), rank, ulysses, causal, window)
    return plan if world == 1 else algorithm.one_document(plan, world, n, causal, window)


def layout_plan(algorithm: str | CPAlgorithm, layout: str, world: int, rank: int, local_len: int, ulysses: int = 1,
                causal: bool = True, window: Window | None = None) -> CPPlan:
    """The plan ``plan_batch`` returns for one document per sample in a static ``layout`` (cached; no process
    group needed): what rank ``rank`` of ``world`` runs, for the planner (``cp_train.perf``)."""
    return _static_plan(algorithm, layout, causal, world, ulysses, rank, local_len, window)


def plan_batch(algorithm: str | CPAlgorithm, groups: CPGroups, layout: str, causal: bool, local_len: int,
                  document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  window: Window | None = None) -> CPPlan | None:
    """This rank's plan for ``algorithm`` (a ``CPAlgorithm`` or its name; None: cp = 1, one document and no
    window, the plain local kernel).

    ``document_ids`` [B, n] restrict attention to each token's document (``position_ids`` [B, n] or [n]
    order tokens within one; default: the layout's); they are gathered over ``groups.cp`` once. ``window``
    bounds every mask (``segments.Window``).
    """
    world, rank = groups.size, groups.rank
    if document_ids is None and layout not in STATIC_LAYOUTS and world > 1:
        raise ValueError(f"the {layout!r} layout places tokens by their documents: pass document_ids and "
                         f"position_ids")
    if document_ids is None:
        if world == 1 and window is None:
            return None
        return _static_plan(algorithm, layout, causal, world, groups.ulysses_size, rank, local_len, window)
    docs, positions = gather_mask_inputs(document_ids, position_ids, groups.cp, layout)
    return plan_from_gathered(algorithm, world, rank, groups.ulysses_size, causal, docs, positions, window)


def plan_from_gathered(algorithm: str | CPAlgorithm, world: int, rank: int, ulysses: int, causal: bool,
                       docs: torch.Tensor, positions: torch.Tensor, window: Window | None = None) -> CPPlan:
    """``plan_batch`` from every CP rank's ``docs`` and ``positions`` ``[world, B, n]`` (int64, CPU, rank
    order): what the all-gather would return. No communication."""
    tokens = tokens_of(docs, positions)
    plan = _plan(get_cp_algorithm(algorithm), tokens, rank, ulysses, causal, window)
    return dataclasses.replace(plan, pairs=_pairs(tokens, causal, window))


def _pairs(tokens: Tokens, causal: bool, window: Window | None = None) -> int:
    """Visible query-key pairs of every sample: per document of ``c`` tokens ``c (c + 1) / 2``, or ``c * c``
    (``window_pairs`` with a window)."""
    counts = torch.bincount(tokens.docs.flatten())
    if window is not None:
        pairs = sum(window_pairs(int(c), causal, window) for c in counts.tolist() if c)
    else:
        pairs = int((counts * (counts + 1) // 2 if causal else counts * counts).sum())
    return pairs if tokens.packed else pairs * tokens.batch


@dataclass(frozen=True)
class SamplePlanner:
    """Builds CP rank ``rank``'s plan where the whole sample is at hand (the data loader's collate, in a worker
    process ahead of the step): no all-gather, no device-to-host copy, no planning inside the step."""

    algorithm: CPAlgorithm
    world: int
    rank: int
    ulysses: int = 1
    causal: bool = True
    window: Window | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", get_cp_algorithm(self.algorithm))  # a name given: resolved once

    def __call__(self, docs: torch.Tensor, positions: torch.Tensor) -> CPPlan:
        return plan_from_gathered(self.algorithm, self.world, self.rank, self.ulysses, self.causal, docs, positions,
                                  self.window)
