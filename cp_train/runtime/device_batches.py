"""Micro-batches on their way to the device: the loader's per-token tensors and CP plan, copied without waiting,
and the loss-token count each carries, read from the CPU mask before the copy (no device read later)."""

from __future__ import annotations

from typing import Any

import torch

from cp_train.data.loader import CP_PLAN
from cp_train.loss import host_sum

MicroBatch = dict[str, Any]  # per-token tensors [B, local_seqlen], and the loader's CP_PLAN
LOCAL_TOKENS = "local_loss_tokens"  # a moved micro-batch's loss tokens, counted from the CPU mask (``to_device``)


def loss_tokens(mb: MicroBatch) -> float:
    """A micro-batch's loss-token count: the one ``to_device`` read from the CPU mask, else its mask's sum."""
    return mb[LOCAL_TOKENS] if LOCAL_TOKENS in mb else float(mb["loss_mask"].sum())


def to_device(micro_batches: list[MicroBatch], device: torch.device) -> list[MicroBatch]:
    """The micro-batches on ``device``: every tensor and the CP plan's index tensors (``CPPlan.to``) copied with
    ``non_blocking=True`` (from pinned memory on a GPU: nothing waits), ahead of the forward. Each also carries
    ``LOCAL_TOKENS``, its loss-token count read from the CPU mask before the copy."""
    moved = []
    for mb in micro_batches:
        movable = (k for k, v in mb.items() if isinstance(v, torch.Tensor) or (k == CP_PLAN and v is not None))
        out = {**mb, **{k: mb[k].to(device, non_blocking=True) for k in movable}}
        mask = mb.get("loss_mask")
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu":
            out[LOCAL_TOKENS] = host_sum(mask)
        moved.append(out)
    return moved
