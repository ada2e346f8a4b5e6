"""Steps slowed down for the signal tests: imported by ``train.py`` through ``train.imports``; every optimizer step
sleeps ``SLOW_STEP_S`` seconds first (unset: 0, a rerun of the same config runs at full speed), so that a signal
sent at one step lands a step or two later even on a busy machine."""

from __future__ import annotations

import os
import time

from cp_train import trainer

_original = trainer.Trainer._step
SECONDS = float(os.environ.get("SLOW_STEP_S", "0"))


def _slow_step(self, micro_batches, read):  # noqa: ANN001, ANN202 - Trainer._step's signature
    if SECONDS:
        time.sleep(SECONDS)
    return _original(self, micro_batches, read)


trainer.Trainer._step = _slow_step
