"""Faults in the order of a rank's collectives, for the collective check's tests: imported by ``train.py`` through
``train.imports``, rank 1 only. ``COLLECTIVE_FAULT`` picks the fault:

- ``skip``: at step 2 rank 1 skips the all-reduce of the attention pairs (``Trainer._step``'s ``device_sums``);
  rank 0 waits in it while rank 1 goes on to the next collective on another group: a hang under NCCL and gloo;
- ``swap``: at step 2 rank 1 all-reduces the attention pairs as int64 instead of float64: the same bytes, so the
  all-reduces pair and complete, silently mixing two types.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from cp_train import trainer

FAULT = os.environ.get("COLLECTIVE_FAULT", "")
_calls = [0]
_original = trainer.device_sums


def _faulty(values, group, device):  # noqa: ANN001, ANN202 - device_sums' signature
    _calls[0] += 1
    if _calls[0] != 2:
        return _original(values, group, device)
    local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if FAULT == "swap":
        as_int = local.to(torch.int64)
        dist.all_reduce(as_int, group=group)
    return local


if os.environ.get("RANK") == "1" and FAULT:
    trainer.device_sums = _faulty
