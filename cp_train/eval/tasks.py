"""The evaluation tasks: their grids, run through a CP forward, as JSON-ready records.

Records (one per grid cell, one per loss bucket), exactly these keys:

- ``passkey`` / ``niah``: ``task, length, depth, trials, accuracy, key_logprob`` (accuracy: the share of
  trials whose every answer token is the argmax; key_logprob: the answer's log-probability, summed over its
  tokens, averaged over the trials);
- ``loss_by_position``: ``task, bucket_start, bucket_end, nll, cum_nll, tokens`` (nll: the mean NLL of the
  predictions whose context within the document is bucket_start..bucket_end tokens; cum_nll: over every
  prediction up to bucket_end), at the largest length.

Trials are split over DP (every DP rank runs the same number of forwards, padding trials weighing nothing),
every CP rank of a replica runs the same ones; the sums are reduced over CP, then DP. A trial's key and
haystack window depend on (seed, length, depth, trial) alone, so every layout sees the same prompts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cp_train.errors import InputError
from cp_train.eval.prompts import Haystack, Prompt, TextTokenizer, niah_prompt, passkey_key, passkey_prompt
from cp_train.eval.scoring import EvalGroups, Forward, answer_scores, bucket_count, position_sums
from cp_train.model.config import ModelConfig

TASKS = ("loss_by_position", "passkey", "niah")
GRID_TASKS = ("passkey", "niah")
Record = dict[str, Any]


def check_tasks(names: Iterable[str]) -> list[str]:
    """``names`` in order without repeats; ``InputError`` for a task that does not exist."""
    names = list(dict.fromkeys(names))
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise InputError(f"unknown eval task {unknown[0] if unknown else '(none given)'!r}: choose from "
                         f"{', '.join(TASKS)}")
    return names


def check_lengths(lengths: Sequence[int], model: ModelConfig, cp: int, layout: str) -> None:
    """``InputError`` for a length the model cannot take: above its positions (one line naming RoPE scaling when
    it has none), or one the CP layout cannot split evenly."""
    for length in lengths:
        if length > model.max_position_embeddings:
            how = ("(the context its RoPE scaling covers)" if model.rope_scaling else
                   "and it has no RoPE scaling: extend its context first (model.rope_scaling, docs/eval.md)")
            raise InputError(f"eval length {length} exceeds the model's max_position_embeddings "
                             f"{model.max_position_embeddings} {how}, or evaluate at --lengths <= "
                             f"{model.max_position_embeddings}")
        try:
            model.check_sequence(length, cp, layout)
        except ValueError as error:
            raise InputError(f"eval length {length}: {error}") from None


@dataclass
class EvalSettings:
    """What to evaluate: tasks, grid (lengths x depths, ``trials`` per cell), the seed of the prompts, and the
    held-out samples of ``loss_by_position``."""

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [256])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 4
    seed: int = 1234
    loss_samples: int = 8

    def __post_init__(self) -> None:
        self.tasks = check_tasks(self.tasks)
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad or not self.depths:
            raise InputError(f"--depths are fractions from 0 to 1, got {bad or 'none'}")
        if self.trials < 1 or self.loss_samples < 1 or not self.lengths:
            raise InputError("--trials and the loss samples must be >= 1 and --lengths not empty")


@dataclass
class EvalContext:
    """How to run the tasks on this rank: the forward, its groups and device, the tokenizer, the haystack
    (made on first use) and the held-out samples (``loss_batches(length, count)``: this DP rank's share of
    ``count`` global samples ``[1, L]``, each with a weight of 0 or 1)."""

    forward: Forward
    groups: EvalGroups
    tokenizer: TextTokenizer
    haystack: Callable[[], Haystack] | None = None
    loss_batches: Callable[[int, int], Iterable[tuple[dict[str, torch.Tensor], float]]] | None = None
    document_mask: bool = True
    device: torch.device | None = None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    _haystack: Haystack | None = None

    def needle_haystack(self) -> Haystack:
        if self._haystack is None:
            if self.haystack is None:
                raise InputError("the niah task needs a haystack (an indexed dataset)")
            self._haystack = self.haystack()
        return self._haystack


def prompt_of(task: str, context: EvalContext, seed: int, length: int, depth: float, trial: int) -> Prompt:
    """The prompt of one trial of ``task`` (passkey or niah)."""
    if task == "passkey":
        return passkey_prompt(context.tokenizer, length, depth, passkey_key(seed, length, depth, trial))
    return niah_prompt(context.tokenizer, context.needle_haystack(), length, depth, f"{seed}-{length}-{depth}-{trial}")


def my_trials(trials: int, groups: EvalGroups) -> list[int]:
    """This DP rank's trials (the same count on every DP rank: indices >= ``trials`` are padding)."""
    per_rank = math.ceil(trials / groups.dp_size)
    return [groups.dp_rank + i * groups.dp_size for i in range(per_rank)]


def grid_cell(task: str, settings: EvalSettings, context: EvalContext, length: int, depth: float) -> Record:
    """One (length, depth) cell of ``task``: its accuracy and mean key log-probability over the trials."""
    sums = torch.zeros(2, dtype=torch.float64)
    for trial in my_trials(settings.trials, context.groups):
        prompt = prompt_of(task, context, settings.seed, length, depth, min(trial, settings.trials - 1))
        with context.autocast():
            exact, logprob = answer_scores(context.forward, torch.tensor([prompt.tokens]), [prompt.answer],
                                           context.groups, context.device)
        if trial < settings.trials:
            sums += torch.stack([exact.double().sum(), logprob.sum()])
    sums = context.groups.reduce(sums.to(context.device), "dp").cpu()
    return {"task": task, "length": length, "depth": depth, "trials": settings.trials,
            "accuracy": float(sums[0]) / settings.trials, "key_logprob": float(sums[1]) / settings.trials}


def loss_by_position(settings: EvalSettings, context: EvalContext) -> list[Record]:
    """The NLL per log2 bucket of the position within the document, at the largest length."""
    if context.loss_batches is None:
        raise InputError("the loss_by_position task needs a held-out indexed dataset")
    length = max(settings.lengths)
    sums = torch.zeros(2, bucket_count(length), dtype=torch.float64, device=context.device)
    for batch, weight in context.loss_batches(length, settings.loss_samples):
        with context.autocast():
            sums += weight * position_sums(context.forward, batch, context.groups, context.document_mask,
                                           context.device)
    sums = context.groups.reduce(sums, "cp", "dp").cpu()
    records, total, tokens = [], 0.0, 0.0
    for bucket in range(sums.shape[1]):
        loss, count = float(sums[0, bucket]), float(sums[1, bucket])
        total, tokens = total + loss, tokens + count
        if count:
            records.append({"task": "loss_by_position", "bucket_start": 2 ** bucket,
                            "bucket_end": min(2 ** (bucket + 1) - 1, length), "nll": loss / count,
                            "cum_nll": total / tokens, "tokens": int(round(count))})
    return records


def run_tasks(settings: EvalSettings, context: EvalContext) -> list[Record]:
    """Every record of ``settings.tasks`` (loss buckets first, then each grid by length and depth)."""
    records: list[Record] = []
    for task in settings.tasks:
        if task == "loss_by_position":
            records += loss_by_position(settings, context)
            continue
        for length in settings.lengths:
            for depth in settings.depths:
                records.append(grid_cell(task, settings, context, length, depth))
    return records
