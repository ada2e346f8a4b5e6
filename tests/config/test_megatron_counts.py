"""Megatron-LM's counts (``cp_train/config/megatron_counts.py``): the run's length and the schedule's warmup and
decay given in samples, as a fraction, or as the step the decay ends at, become cp-train's step counts, and the
learning rate reaches ``min_lr`` at the step Megatron-LM's would; ``--set`` still wins; what has no equivalent is
one line."""

from __future__ import annotations

import pytest

from cp_train.config.flags import parse_config
from cp_train.config.schema import ConfigError
from cp_train.optim import LRSchedule

CONFIG = ["--config", "launch/configs/cpu-tiny.yaml", "--lr", "1e-3", "--min-lr", "1e-4"]


def counts(argv: list[str]) -> tuple[int, int, int | None, tuple[str, ...]]:
    config = parse_config(CONFIG + argv)
    return config.train.steps, config.schedule.warmup_steps, config.schedule.decay_steps, config.deprecations


@pytest.mark.parametrize(("argv", "steps", "warmup", "decay", "end"), [
    # the decay ends at --lr-decay-iters, warmup included (ours counts the decay after the warmup)
    ("--train-iters 1000 --lr-warmup-iters 100 --lr-decay-iters 800", 1000, 100, 700, 800),
    # samples of 8 per step; the warmup a fraction of the decay's end
    ("--global-batch-size 8 --train-samples 8000 --lr-decay-samples 6400 --lr-warmup-fraction 0.01", 1000, 8, 792,
     800),
    # the decay's end by default the run's last step
    ("--train-iters 500 --lr-warmup-fraction 0.1", 500, 50, None, 500),
    ("--global-batch-size 8 --train-samples 4000 --lr-warmup-samples 400", 500, 50, None, 500),
])
def test_megatron_counts_become_steps_and_the_decay_ends_where_megatron_ends_it(argv: str, steps: int, warmup: int,
                                                                               decay: int | None, end: int) -> None:
    config = parse_config(CONFIG + argv.split())
    assert (config.train.steps, config.schedule.warmup_steps, config.schedule.decay_steps) == (steps, warmup, decay)
    schedule = LRSchedule(config.optimizer, config.schedule, config.train.steps)
    assert schedule(warmup - 1) == pytest.approx(1e-3)  # the warmup's last step reaches the peak
    assert schedule(end - 1) > 1e-4 + 1e-9 and schedule(end) == pytest.approx(1e-4)  # min_lr from the decay's end


def test_wsd_uncounted_samples_and_set_overrides() -> None:
    steps, warmup, decay, notes = counts("--global-batch-size 8 --train-samples 8004 --lr-decay-style wsd "
                                        "--lr-wsd-decay-samples 1604 --lr-warmup-iters 10".split())
    assert (steps, warmup, decay) == (1000, 10, 200)  # --train-samples rounds down, as Megatron-LM's
    assert notes[-1] == ("Megatron-LM's --lr-wsd-decay-samples 1604 is 200.5 steps of --global-batch-size 8: 200 "
                         "steps")
    assert counts("--train-iters 100 --lr-decay-iters 80 --set schedule.decay_steps=5".split())[2] == 5


@pytest.mark.parametrize(("argv", "words"), [
    ("--train-samples 800 --train-iters 100", "--train-samples and --train-iters (--train-steps) both set the "
                                               "run's length: pass one"),
    ("--train-samples 800 --gradient-accumulation-steps 2", "--train-samples counts samples: give the samples per "
                                                           "step with --global-batch-size"),
    ("--global-batch-size 8 --train-samples 4", "--train-samples 4 is less than one step of --global-batch-size 8"),
    ("--train-iters 100 --lr-warmup-iters 20 --lr-decay-iters 20", "the learning rate's decay ends at step 20 "
                                                                   "(Megatron-LM's --lr-decay-iters), not after"),
    ("--train-iters 100 --lr-warmup-iters 5 --lr-warmup-fraction 0.1", "--lr-warmup-iters both set the warmup"),
    ("--train-iters 100 --lr-decay-iters 90 --lr-decay-samples 720", "--lr-decay-iters and --lr-decay-samples both set "
                                                                      "the same count: pass one"),
    ("--train-iters 100 --lr-decay-iters 0", "argument --lr-decay-iters: must be a positive integer, got '0'"),
    ("--train-iters 100 --lr-warmup-fraction 1.5", "argument --lr-warmup-fraction: must be at least 0 and below 1, "
                                                   "got '1.5'"),
    ("--train-iters 100 --lr-decay-style wsd --lr-decay-iters 90", "the decay's end (90 steps) must be "
                                                                   "--train-steps 100; drop --lr-decay-iters"),
])
def test_what_has_no_equivalent_is_one_line(argv: str, words: str) -> None:
    with pytest.raises(ConfigError, match=r".*") as error:
        parse_config(CONFIG + argv.split())
    assert words in str(error.value) and "\n" not in str(error.value), error.value
