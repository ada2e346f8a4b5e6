"""The layouts the trainer can run for a model, sequence and GPU count, each predicted, the best first.

A candidate is a full run config: tp x cp x dp, the CP algorithm (hybrid with each Ulysses size), the CP
layout, FSDP, activation checkpointing with ``mlp_chunks`` and the micro-batch. Each is checked by the
trainer's own validation (``cp_train.config.validate``), so a layout the trainer would reject is rejected
here for the same reason (the reasons are counted). Fixed choices (the command line's layout flags) narrow the
space to them.

The time model (``predict.py``, mostly its CP plans) costs a quarter of a second per layout and the memory plan
a few hundredths, so the search prunes before predicting (``PRUNING``): a layout that cannot fit the device is
never timed, and a layout that the model makes slower than one that fits is never timed either. Of a group of
candidates that differ only in checkpointing, ``mlp_chunks`` and the micro-batch:

- the state bound: every rank holds at least ``STATE_BYTES_PER_PARAMETER`` bytes per parameter it owns (fp32
  weights, gradients and AdamW's two moments, over tp, and over dp x cp with FSDP); above the device, none fits;
- lighter first: full checkpointing needs no more memory than selective, selective no more than none, 4 MLP
  chunks no more than 1, and, among micro-batches that accumulate gradients, a smaller one no more than a larger:
  when the lightest does not fit, the heavier ones are not planned;
- dominated: no checkpointing with one MLP chunk is the fastest of its micro-batch: when it fits, the others of
  that micro-batch are not timed.

``tests/perf/test_search_pruning.py`` checks these orders on the memory plan and the time model, and that the
pruned search ranks the fitting layouts as the exhaustive one does.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cp_train.config.schema import Config, ConfigError
from cp_train.config.validate import validate
from cp_train.memory.dry_run import GIB, memory_plan
from cp_train.parallel.cp.algorithms.registry import BUILT_IN, get_cp_algorithm
from cp_train.perf.inputs.presets import parameter_count
from cp_train.perf.predict import Prediction, predict
from cp_train.perf.rates import DeviceRates

RING_LAYOUTS = ("zigzag", "stripe", "contiguous")  # one document per sample: the static layouts
DOCUMENT_LAYOUTS = (*RING_LAYOUTS, "balanced")  # packed documents: the balanced layout places them too
CHECKPOINTING = ("none", "selective", "full")
STATE_BYTES_PER_PARAMETER = 16  # fp32 weight and gradient, AdamW's two fp32 moments
LIGHTNESS = {"full": 0, "selective": 1, "none": 2}  # less activation memory first
PRUNING = ("cannot fit", "dominated")


@dataclass(frozen=True)
class Choices:
    """The values searched for each setting; a command-line flag fixes one to a single value."""

    tp: tuple[int, ...] | None = None  # None: every power of two within a node that divides the GPUs
    cp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    algorithms: tuple[str, ...] = tuple(BUILT_IN)
    layouts: tuple[str, ...] | None = None  # None: RING_LAYOUTS where every rank keeps all heads, else zigzag
    fsdp: tuple[bool, ...] = (True, False)
    checkpointing: tuple[str, ...] = CHECKPOINTING
    mlp_chunks: tuple[int, ...] | None = None  # None: 1, and 4 without checkpointing
    micro_batches: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to the global batch per DP rank
    ulysses: tuple[int, ...] | None = None  # hybrid's Ulysses sizes; None: every power of two in (1, cp)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def candidates(base: Config, gpus: int, gpus_per_node: int, choices: Choices, documents: bool = False
               ) -> Iterator[Config]:
    """Every combination of ``choices`` for ``gpus`` GPUs, as configs derived from ``base`` (unvalidated)."""
    tps = choices.tp or tuple(t for t in _powers_of_two(min(gpus, gpus_per_node)) if gpus % t == 0)
    samples = base.train.global_batch_size
    pairs = [(tp, cp) for tp in tps for cp in choices.cp or _powers_of_two(max(1, gpus // tp))]
    dividing = [(tp, cp) for tp, cp in pairs if gpus % (tp * cp) == 0]
    for tp, cp in dividing or pairs:  # none divides: every pair, for the trainer's check to say why
        dp = gpus // (tp * cp) if gpus % (tp * cp) == 0 else None
        if choices.dp and dp is not None and dp not in choices.dp:
            continue
        for algorithm in (choices.algorithms if cp > 1 else choices.algorithms[:1]):
            resolved = get_cp_algorithm(algorithm)
            ulysses_sizes = (choices.ulysses or [u for u in _powers_of_two(cp) if 1 < u < cp]
                             if resolved.subgroups else [1])
            layouts = choices.layouts or ((DOCUMENT_LAYOUTS if documents else RING_LAYOUTS)
                                          if resolved.head_degree(cp, 2) == 1 and cp > 1 else ("zigzag",))
            micro = choices.micro_batches or tuple(m for m in _powers_of_two(max(1, samples // (dp or 1))))
            for ulysses, layout, fsdp, mode, batch in itertools.product(
                    ulysses_sizes, layouts, choices.fsdp, choices.checkpointing, micro):
                for chunks in choices.mlp_chunks or ((1, 4) if mode == "none" else (1,)):
                    config = copy.deepcopy(base)
                    p = config.parallel
                    p.tp, p.cp, p.dp, p.cp_algorithm, p.ulysses_size = tp, cp, dp, algorithm, ulysses
                    p.cp_layout, p.fsdp = layout, fsdp
                    config.model.activation_checkpointing, config.model.mlp_chunks = mode, chunks
                    config.train.micro_batch_size = batch
                    yield config


@dataclass
class SearchResult:
    ranked: list[Prediction]  # fitting layouts first, by tokens/s per GPU; then the nearest to fitting, by memory
    rejected: Counter  # the trainer's reasons, counted
    evaluated: int  # layouts searched (refused, pruned or predicted)
    total: int = 0  # layouts in the search space
    pruned: Counter = field(default_factory=Counter)  # PRUNING's reasons, counted
    stopped: bool = False  # the time limit stopped the search before every layout was searched
    elapsed_s: float = 0.0

    @property
    def best(self) -> Prediction | None:
        """The fastest fitting layout so far."""
        return self.ranked[0] if self.ranked and self.ranked[0].fits else None

    def summary(self) -> str:
        """``6,856 layouts: 0 refused by the trainer, 6,700 cannot fit, 120 dominated, 36 predicted, 36 fit``."""
        fits = sum(p.fits for p in self.ranked)
        searched = f"{self.evaluated:,} of {self.total:,} layouts searched" if self.stopped else \
            f"{self.total:,} layouts"
        return (f"{searched}: {sum(self.rejected.values()):,} refused by the trainer, {self.pruned['cannot fit']:,} "
                f"cannot fit, {self.pruned['dominated']:,} slower than one that fits, {len(self.ranked):,} predicted, "
                f"{fits:,} fit")

    def progress_line(self) -> str:
        """The search so far in one line: layouts searched of all, seconds, the best fitting one."""
        best = self.best
        where = "none fits yet" if best is None else (
            f"best so far {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU ({layout_name(best.config)})")
        return f"searched {self.evaluated:,}/{self.total:,} layouts in {self.elapsed_s:.0f} s; {where}"


def layout_name(config: Config) -> str:
    """``tp 1 cp 8 dp 1 ulysses fsdp selective mb 1``: a layout in a few words."""
    p, m = config.parallel, config.model
    algorithm = f" {p.cp_algorithm}" + (f" u{p.ulysses_size}" if get_cp_algorithm(p.cp_algorithm).subgroups else "")
    return (f"tp {p.tp} cp {p.cp} dp {p.dp}{algorithm if p.cp > 1 else ''}{' ' + p.cp_layout if p.cp > 1 else ''}"
            f"{' fsdp' if p.fsdp else ''} {m.activation_checkpointing}"
            f"{f' mlp {m.mlp_chunks}' if m.mlp_chunks > 1 else ''} mb {config.train.micro_batch_size}")


def state_bound_gib(config: Config, gpus: int) -> float:
    """The least memory any rank of ``config`` can hold, in GiB: the weights, gradients and AdamW moments of its
    share of the parameters (a lower bound of the memory plan's)."""
    p = config.parallel
    shards = p.tp * (gpus // p.tp if p.fsdp else 1)  # FSDP shards over dp x cp = gpus / tp
    return STATE_BYTES_PER_PARAMETER * parameter_count(config.model) / shards / GIB


def _group_key(config: Config) -> tuple:
    """What the members of a pruning group share: all but checkpointing, ``mlp_chunks`` and the micro-batch."""
    p = config.parallel
    return p.tp, p.cp, p.dp, p.cp_algorithm, p.ulysses_size, p.cp_layout, p.fsdp


def _lightness(config: Config) -> tuple[int, int]:
    return LIGHTNESS[config.model.activation_checkpointing], -config.model.mlp_chunks


def _fastest(config: Config) -> bool:
    return config.model.activation_checkpointing == "none" and config.model.mlp_chunks == 1


class _Search:
    """One search's state: the memory of the layouts planned, the predictions, the counts."""

    def __init__(self, gpus: int, rates: DeviceRates, peak_tflops: float, device_gib: float, reserve_gib: float,
                 documents: tuple[int, ...] | None, result: SearchResult) -> None:
        self.gpus, self.rates, self.peak, self.device_gib, self.reserve = gpus, rates, peak_tflops, device_gib, \
            reserve_gib
        self.usable, self.documents, self.result = device_gib - reserve_gib, documents, result
        self.unfit: list[tuple[float, int, Config]] = []  # (GiB or a lower bound, order, config): the nearest to fit

    def memory_gib(self, config: Config) -> float:
        return max(r.total_bytes for r in memory_plan(config, self.gpus, only=[0])[1]) / GIB

    def predict(self, config: Config) -> None:
        self.result.ranked.append(predict(config, self.gpus, self.rates, self.peak, self.device_gib, self.reserve,
                                          self.documents))

    def cannot_fit(self, configs: list[Config], gib: float) -> None:
        """``configs`` need at least ``gib`` (above the device): pruned, kept as candidates nearest to fitting."""
        self.result.pruned["cannot fit"] += len(configs)
        self.unfit += [(gib, len(self.unfit), config) for config in configs]

    def group(self, members: list[Config]) -> None:
        """Plan the members of one pruning group (valid configs sharing ``_group_key``) lightest first."""
        bound = state_bound_gib(members[0], self.gpus)
        if bound > self.usable:
            return self.cannot_fit(members, bound)
        global_batch, dp = members[0].train.global_batch_size, members[0].parallel.dp or 1
        micros = sorted({c.train.micro_batch_size for c in members})
        floor = 0.0  # the lightest plan of a smaller accumulating micro-batch that did not fit (0: none)
        for micro in micros:
            batch = sorted((c for c in members if c.train.micro_batch_size == micro), key=_lightness)
            accumulates = micro * dp < global_batch
            if accumulates and floor:
                self.cannot_fit(batch, floor)
                continue
            lightest = self.memory_gib(batch[0])
            if lightest > self.usable:
                self.cannot_fit(batch, lightest)
                floor = lightest if accumulates else floor
                continue
            self.micro_batch(batch, lightest)

    def micro_batch(self, batch: list[Config], lightest: float) -> None:
        """One micro-batch's members, the lightest (``batch[0]``, needing ``lightest`` GiB) fitting: the fastest
        alone when it fits, else every member that fits."""
        fastest = next((c for c in batch if _fastest(c)), None)
        if fastest is not None:
            need = lightest if fastest is batch[0] else self.memory_gib(fastest)
            if need <= self.usable:
                self.predict(fastest)
                self.result.pruned["dominated"] += len(batch) - 1
                return
            self.cannot_fit([fastest], need)
        for config in batch:
            if config is fastest:
                continue
            need = lightest if config is batch[0] else self.memory_gib(config)
            if need <= self.usable:
                self.predict(config)
            else:
                self.cannot_fit([config], need)

    def nearest_unfit(self, count: int) -> None:
        """Predict the ``count`` pruned layouts nearest to fitting (for the table when few or none fit)."""
        for _, _, config in sorted(self.unfit, key=lambda entry: entry[:2])[:max(0, count)]:
            self.predict(config)


def _without_cyclic_collection(fn: Callable[..., SearchResult]) -> Callable[..., SearchResult]:
    """``fn`` with Python's automatic cyclic collection off, as the trainer's loop runs (``runtime/collector.py``):
    the plans and segments a search makes by the million hold no cycles, and the collector's passes over them
    took a third of a search with packed documents."""
    @functools.wraps(fn)
    def without(*args: object, **kwargs: object) -> SearchResult:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return without


@_without_cyclic_collection
def search(base: Config, gpus: int, rates: DeviceRates, peak_tflops: float, device_gib: float, reserve_gib: float,
           choices: Choices = Choices(), documents: tuple[int, ...] | None = None, *, keep: int = 10,
           max_seconds: float | None = None, progress: Callable[[SearchResult], None] | None = None,
           progress_every_s: float = 5.0) -> SearchResult:
    """Predict the layouts of ``choices`` that fit and no faster one of their group beats (the module docstring);
    ``ranked`` holds the fitting ones, faster first, then, when fewer than ``keep`` fit, the pruned ones nearest to
    fitting (predicted, memory ascending). ``documents``: the lengths of the documents packed into each sample
    (None: one per sample). ``max_seconds`` stops the search after the group that passes it (``stopped``);
    ``progress`` is called with the result so far every ``progress_every_s`` seconds."""
    started = time.monotonic()
    configs = list(candidates(base, gpus, rates.gpus_per_node, choices, documents is not None))
    result = SearchResult([], Counter(), 0, len(configs))
    state = _Search(gpus, rates, peak_tflops, device_gib, reserve_gib, documents, result)
    groups: dict[tuple, list[Config]] = {}
    for config in configs:
        groups.setdefault(_group_key(config), []).append(config)
    reported = started
    for members in groups.values():
        valid = []
        for config in members:
            try:
                validate(config, gpus)
                valid.append(config)
            except ConfigError as error:
                result.rejected[str(error)] += 1
        if valid:
            state.group(valid)
        result.evaluated += len(members)
        result.ranked.sort(key=lambda p: -p.tokens_per_s_per_gpu)
        result.elapsed_s = time.monotonic() - started
        if progress is not None and time.monotonic() - reported >= progress_every_s:
            progress(result)
            reported = time.monotonic()
        if max_seconds is not None and result.elapsed_s > max_seconds and result.evaluated < result.total:
            result.stopped = True
            break
    state.nearest_unfit(keep - len(result.ranked))
    result.ranked.sort(key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu if p.fits else p.memory_gib["total"]))
    result.elapsed_s = time.monotonic() - started
    return result
