"""Megatron-LM's counts of the run and of its learning-rate schedule, read in Megatron-LM's sense.

Megatron-LM counts the schedule in samples: the decay ends at ``--lr-decay-iters`` (warmup included; default
``--train-iters``), the warmup is ``--lr-warmup-iters`` or ``--lr-warmup-fraction`` of the decay's end, WSD's
decay is the last ``--lr-wsd-decay-iters`` before that end, and a run given in samples (``--train-samples``,
``--lr-decay-samples``, ``--lr-warmup-samples``, ``--lr-wsd-decay-samples``) takes ``samples // global batch``
steps. cp-train's keys count optimizer steps, the decay's after the warmup (``schedule.decay_steps``):
``read_megatron_counts`` sets ``train.steps``, ``schedule.warmup_steps`` and ``schedule.decay_steps`` from those
flags once every layer is merged (so a global batch or a warmup from the YAML counts), leaving alone a key that
``--set`` gives. A count that is not a whole number of steps is rounded, with a note; what has no equivalent
(a batch from ``--gradient-accumulation-steps``, a WSD decay that ends before the run's last step) is a
``ConfigError`` saying what to pass.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from cp_train.config.arg_types import fraction, positive_int
from cp_train.config.schema import Config, ConfigError

# Megatron-LM's flag -> (its argparse type, its help); argparse dest: MEGATRON_COUNT_DEST + name
MEGATRON_COUNTS: dict[str, tuple[Callable[[str], Any], str]] = {
    "train-samples": (positive_int, "the run's length in samples: --train-steps samples // --global-batch-size"),
    "lr-decay-iters": (positive_int, "the step the decay ends at, warmup included (default: the run's last)"),
    "lr-decay-samples": (positive_int, "the same in samples"),
    "lr-warmup-samples": (positive_int, "the warmup in samples"),
    "lr-warmup-fraction": (fraction, "the warmup, a fraction of the decay's end"),
    "lr-wsd-decay-iters": (positive_int, "--lr-decay-style wsd: the decay's steps, before the run's last"),
    "lr-wsd-decay-samples": (positive_int, "the same in samples"),
}
MEGATRON_COUNT_DEST = "megatron-count:"


def _steps(given: dict[str, Any], iters: str | None, samples: str, batch: int, notes: list[str]) -> int | None:
    """The steps that ``--{iters}`` or ``--{samples}`` (``batch`` samples per step) give, or None for neither."""
    if iters and iters in given:
        return given[iters]
    if samples not in given:
        return None
    steps = max(1, round(given[samples] / batch))
    if steps * batch != given[samples]:
        notes.append(f"Megatron-LM's --{samples} {given[samples]} is {given[samples] / batch:g} steps of "
                     f"--global-batch-size {batch}: {steps} steps")
    return steps


def read_megatron_counts(config: Config, given: dict[str, Any], flag_keys: set[str], overrides: set[str]
                         ) -> list[str]:
    """Set ``config``'s step counts from Megatron-LM's flags ``given`` (name -> value; see the module docstring),
    except the keys in ``overrides`` (``--set``'s); ``flag_keys``: the keys our own flags set. The notes to log."""
    if not given:
        return []
    notes: list[str] = []
    both = [f"--{a}" for a in ("train-samples", "lr-decay-samples", "lr-warmup-samples") if a in given]
    if both and config.train.gradient_accumulation_steps is not None:
        raise ConfigError(f"Megatron-LM's {both[0]} counts samples: give the samples per step with "
                          f"--global-batch-size, not --gradient-accumulation-steps")
    if "train-samples" in given and "train.steps" in flag_keys:
        raise ConfigError("Megatron-LM's --train-samples and --train-iters (--train-steps) both set the run's "
                          "length: pass one")
    for iters, samples in (("lr-decay-iters", "lr-decay-samples"), ("lr-wsd-decay-iters", "lr-wsd-decay-samples"),
                           ("lr-warmup-fraction", "lr-warmup-samples")):
        if iters in given and samples in given:
            raise ConfigError(f"Megatron-LM's --{iters} and --{samples} both set the same count: pass one")
    if {"lr-warmup-fraction", "lr-warmup-samples"} & set(given) and "schedule.warmup_steps" in flag_keys:
        raise ConfigError("Megatron-LM's --lr-warmup-fraction (or --lr-warmup-samples) and --lr-warmup-iters both set "
                          "the warmup: pass one")
    batch = config.train.global_batch_size
    if "train-samples" in given and "train.steps" not in overrides:  # as Megatron-LM: whole steps, rounded down
        config.train.steps = given["train-samples"] // batch
        if config.train.steps < 1:
            raise ConfigError(f"Megatron-LM's --train-samples {given['train-samples']} is less than one step of "
                              f"--global-batch-size {batch}: raise it")
    end = _steps(given, "lr-decay-iters", "lr-decay-samples", batch, notes) or config.train.steps
    warmup = config.schedule.warmup_steps
    if "lr-warmup-fraction" in given:
        warmup = round(given["lr-warmup-fraction"] * end)
    elif (from_samples := _steps(given, None, "lr-warmup-samples", batch, notes)) is not None:
        warmup = from_samples
    if "schedule.warmup_steps" not in overrides:
        config.schedule.warmup_steps = warmup
    wsd = _steps(given, "lr-wsd-decay-iters", "lr-wsd-decay-samples", batch, notes)
    if config.schedule.decay == "wsd":
        if end != config.train.steps:
            raise ConfigError(f"--lr-decay-style wsd decays to the run's last step here: the decay's end "
                              f"({end} steps) must be --train-steps {config.train.steps}; drop --lr-decay-iters")
        decay = wsd
    else:
        explicit = "lr-decay-iters" in given or "lr-decay-samples" in given
        decay = end - config.schedule.warmup_steps if explicit else None
        if decay is not None and decay < 1:
            raise ConfigError(f"the learning rate's decay ends at step {end} (Megatron-LM's --lr-decay-iters), "
                              f"not after the warmup's {config.schedule.warmup_steps} steps: raise it")
    if decay is not None and "schedule.decay_steps" not in overrides:
        config.schedule.decay_steps = decay
    return notes


def add_megatron_counts(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's count flags on ``parser`` (dest ``MEGATRON_COUNT_DEST + name``), in a group of their own."""
    group = parser.add_argument_group("Megatron-LM's counts", "read in Megatron-LM's sense "
                                      "(cp_train/config/megatron_counts.py)")
    for name, (kind, text) in MEGATRON_COUNTS.items():
        group.add_argument(f"--{name}", dest=MEGATRON_COUNT_DEST + name, type=kind, default=None,
                           metavar="F" if kind is fraction else "N", help=text)
