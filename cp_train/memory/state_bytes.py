"""What the training state occupies on each rank, measured from the tensors themselves.

``state_bytes(model, optimizer)`` counts the storage this rank holds for the parameters, the gradients
and the optimizer state (a DTensor counts its local shard; storages shared by several tensors, such as
DDP's gradient buckets or FSDP's padded shards, count once, at their full size); ``optimizer_state_bytes`` predicts
the optimizer's part for parameter shapes without the parameters (the dry run). ``setup_record``
gathers every rank's figures into the run's first ``metrics.jsonl`` record (``"kind": "setup"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cp_train.config.schema import OptimizerConfig
from cp_train.model.shards import local_tensor
from cp_train.optim import build_optimizer


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


def optimizer_state_bytes(optimizer: OptimizerConfig, shapes: list[torch.Size]) -> int:
    """The bytes of the state AdamW (``build_optimizer``) keeps for fp32 parameters of ``shapes`` (moments and
    step counts), without running it on them: from one step on a small probe per number of dims."""
    key = dataclasses.astuple(optimizer)
    return sum(nbytes // 3 ** len(shape) * shape.numel() if scales else nbytes
               for shape in shapes for scales, nbytes in _state_layout(optimizer, key, len(shape)))


_LAYOUTS: dict[tuple, tuple[tuple[bool, int], ...]] = {}  # state per parameter, by (optimizer, dims)


def _state_layout(optimizer: OptimizerConfig, key: tuple, dims: int) -> tuple[tuple[bool, int], ...]:
    """The state AdamW (``optimizer``, ``key`` its values) keeps for an fp32 parameter of ``dims`` dims, as
    ``(scales, bytes)`` per state tensor: what one step of the real optimizer makes for a meta probe of that many
    dims (3 x ... x 3), each state tensor either of the parameter's shape (``scales``: ``bytes`` is the probe's)
    or of its own size (the step count)."""
    if (key, dims) not in _LAYOUTS:
        probe = torch.nn.Parameter(torch.empty((3,) * dims, device="meta"))
        probe.grad = torch.empty_like(probe)
        adamw = build_optimizer(torch.nn.ParameterList([probe]), replace(optimizer, implementation="foreach"),
                                torch.device("meta"))  # the same state as fused, which meta tensors refuse
        adamw.step()  # AdamW creates its state (on the meta device, the step count on the CPU)
        _LAYOUTS[key, dims] = tuple((value.shape == probe.shape and dims > 0, value.numel() * value.element_size())
                                    for value in adamw.state[probe].values() if torch.is_tensor(value))
    return _LAYOUTS[key, dims]
