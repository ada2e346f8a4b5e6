"""Build a ``GPTModel`` without allocating it (meta device), then give each rank only its shards.

    model = meta_model(config, state.model_parallel("zigzag"))   # shapes only, TP attributes kept
    ... wrap it (fully_shard) while it is still on the meta device ...
    allocate(model, device)                                      # uninitialised local shards
    materialize(model)                                           # the seeded values of those shards

``materialize`` draws the model's seeded initialisation one unit at a time (the embedding, one block,
the norm, the head; ``GPTModel.reference_units``) at full size on the CPU and copies out the block each
local parameter holds (``model.shards.local_region``). A rank thus never holds the full model, only its
shards plus one full unit while it is drawn, and the values are bitwise those of a full build of the
same seed (``GPTModel(...)`` on a real device), in every layout, with or without FSDP.
"""

from __future__ import annotations

import torch

from cp_train.model.config import ModelConfig
from cp_train.model.family import get_model_family
from cp_train.model.gpt import GPTModel
from cp_train.model.shards import local_region, local_tensor, mark_tensor_parallel, tensor_parallel_dims
from cp_train.parallel.mesh.model_parallel import ModelParallel


def meta_model(config: ModelConfig, parallel: ModelParallel | None = None,
               dtype: torch.dtype | None = None) -> GPTModel:
    """The model of ``config``'s family (``GPTModel``) on the meta device: this rank's TP shapes and attributes, no
    storage, no init."""
    with torch.device("meta"):
        return get_model_family(config.family).build(config, parallel, dtype=dtype)


def allocate(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every (local) parameter uninitialised storage on ``device``, keeping the TP attributes."""
    dims = tensor_parallel_dims(model)
    model.to_empty(device=device)
    mark_tensor_parallel(model, dims)


@torch.no_grad()
def materialize(model: GPTModel) -> None:
    """Fill every parameter's local block (its TP and FSDP shard) with the seeded initial values."""
    tp_size, tp_rank = model.parallel.tp_size, model.parallel.tp_rank
    params = dict(model.named_parameters())
    for prefix, unit in model.reference_units():
        for name, full in unit.named_parameters():
            param = params.pop(f"{prefix}.{name}")
            local_tensor(param).copy_(full[local_region(param, tp_rank, tp_size)])
        del unit
    if params:
        raise RuntimeError(f"no reference values for {', '.join(params)}: GPTModel.reference_units is out of date")
