"""What the training state occupies on each rank, measured from the tensors themselves.

``state_bytes(model, optimizer)`` counts the storage this rank holds for the parameters, the gradients
and the optimizer state (a DTensor counts its local shard; storages shared by several tensors, such as
DDP's gradient buckets or FSDP's padded shards, count once, at their full size). ``setup_record``
gathers every rank's figures into the run's first ``metrics.jsonl`` record (``"kind": "setup"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cp_train.model.shards import local_tensor


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (their local shards for DTensors)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` and their sum ``state_bytes``."""
    params = list(model.parameters())
    moments = [value for entry in optimizer.state.values() for value in entry.values() if torch.is_tensor(value)]
    out = {"parameter_bytes": held_bytes(params),
           "gradient_bytes": held_bytes(p.grad for p in params if p.grad is not None),
           "optimizer_bytes": held_bytes(moments)}
    out["state_bytes"] = sum(out.values())
    return out


def setup_record(model: nn.Module, optimizer: torch.optim.Optimizer, counts: dict[str, int],
                 extra: dict[str, Any]) -> dict[str, Any]:
    """The ``{"kind": "setup"}`` record (collective: every rank's figures are gathered): the whole model's
    ``parameters``, and per rank (the largest, and every rank's in rank order) the parameters and the state
    bytes. ``counts`` is this rank's ``build.describe``; ``extra`` (layout, fsdp, ...) is copied in."""
    mine = {"parameters_per_rank": counts["parameters_per_rank"], **state_bytes(model, optimizer)}
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
    record: dict[str, Any] = {"kind": "setup", "parameters": counts["parameters"], **extra}
    for key in mine:
        name = key if key.endswith("_per_rank") else f"{key}_per_rank"
        record[name] = max(rank[key] for rank in everyone)
        record[name.removesuffix("_per_rank") + "_by_rank"] = [rank[key] for rank in everyone]
    return record
