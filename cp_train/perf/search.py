"""The layouts the trainer can run for a model, sequence and GPU count, each predicted, the best first.

A candidate is a full run config: tp x cp x dp, the CP algorithm (hybrid with each Ulysses size), the CP
layout, FSDP, activation checkpointing with ``mlp_chunks`` and the micro-batch. Each is checked by the
trainer's own validation (``cp_train.config.validate``), so a layout the trainer would reject is rejected
here for the same reason (the reasons are counted), then predicted (``predict.py``). Fixed choices (the
command line's layout flags) narrow the space to them.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from cp_train.config.schema import Config, ConfigError
from cp_train.config.validate import validate
from cp_train.parallel.cp.algorithms.registry import BUILT_IN, get_cp_algorithm
from cp_train.perf.predict import Prediction, predict
from cp_train.perf.rates import DeviceRates

RING_LAYOUTS = ("zigzag", "stripe", "contiguous")  # one document per sample: the static layouts
DOCUMENT_LAYOUTS = (*RING_LAYOUTS, "balanced")  # packed documents: the balanced layout places them too
CHECKPOINTING = ("none", "selective", "full")


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
    ranked: list[Prediction]  # fitting layouts first, then by tokens/s per GPU
    rejected: Counter  # the trainer's reasons, counted
    evaluated: int


def search(base: Config, gpus: int, rates: DeviceRates, peak_tflops: float, device_gib: float, reserve_gib: float,
           choices: Choices = Choices(), documents: tuple[int, ...] | None = None) -> SearchResult:
    """Predict every valid candidate; ``ranked`` holds them all, the fitting ones first, faster first.
    ``documents``: the lengths of the documents packed into each sample (None: one per sample)."""
    predictions, rejected = [], Counter()
    for config in candidates(base, gpus, rates.gpus_per_node, choices, documents is not None):
        try:
            validate(config, gpus)
        except ConfigError as error:
            rejected[str(error)] += 1
            continue
        predictions.append(predict(config, gpus, rates, peak_tflops, device_gib, reserve_gib, documents))
    predictions.sort(key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu))
    return SearchResult(predictions, rejected, len(predictions) + sum(rejected.values()))
