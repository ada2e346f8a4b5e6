"""Which block of a full (unsharded) parameter this rank holds, under tensor parallelism and FSDP.

A ``GPTModel`` parameter is first split over TP: a parameter with ``tensor_model_parallel`` holds chunk
``tp_rank`` of the full tensor along its ``partition_dim``. With FSDP, FSDP2 splits that TP-local tensor
again over the DP x CP mesh along one dim (a ``DTensor`` with a ``Shard(dim)`` placement; ``torch.chunk``
semantics: chunks of ``ceil(n / ranks)``, trailing ranks may hold less or nothing). ``local_region``
gives the slices of the full tensor that this rank's local tensor holds: the seeded initialisation, the
Hugging Face loader and the checkpoint views all work on that region, so no rank needs the full model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from cp_train.parallel.tp.fp8 import storage_tensor


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds for ``param`` (a DTensor's local shard; writes reach the parameter), plain: an FP8
    weight's storage under its FSDP float8 wrapper (``parallel/tp/fp8.py``)."""
    return storage_tensor(param.to_local() if isinstance(param, DTensor) else param.data)


def tensor_parallel_dim(param: torch.Tensor) -> int | None:
    """The dim ``param`` is split along over TP (``partition_dim``), or None when it is replicated."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None  # type: ignore[attr-defined]


def tensor_parallel_dims(model: nn.Module) -> dict[str, int | None]:
    """``{parameter name: tensor_parallel_dim}`` of every parameter of ``model``."""
    return {name: tensor_parallel_dim(param) for name, param in model.named_parameters()}


def mark_tensor_parallel(model: nn.Module, dims: dict[str, int | None]) -> None:
    """Put the TP attributes of ``dims`` (from ``tensor_parallel_dims``) back on ``model``'s parameters: wrapping
    (``fully_shard``) and ``to_empty`` replace the Parameter objects and drop them."""
    for name, param in model.named_parameters():
        if dims.get(name) is not None:
            param.tensor_model_parallel, param.partition_dim = True, dims[name]  # type: ignore[attr-defined]


def chunk_start(length: int, parts: int, index: int) -> int:
    """Where chunk ``index`` of ``torch.chunk(range(length), parts)`` starts (``length`` past the last chunk)."""
    size = -(-length // parts)
    return min(index * size, length)


def data_shards(param: torch.Tensor) -> dict[str, int]:
    """``{mesh dim name: tensor dim}`` of the Shard placements of a DTensor parameter (FSDP's), else ``{}``."""
    if not isinstance(param, DTensor):
        return {}
    names = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(param.device_mesh.ndim))
    return {name: placement.dim for name, placement in zip(names, param.placements, strict=True)
            if isinstance(placement, Shard)}


def local_region(param: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[slice, ...]:
    """The slices of the full tensor that this rank's ``local_tensor(param)`` holds."""
    local = local_tensor(param)
    starts = [0] * local.dim()
    tp_dim = tensor_parallel_dim(param)
    if tp_dim is not None:
        starts[tp_dim] += tp_rank * param.shape[tp_dim]  # a DTensor's shape is the TP-local shape
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                starts[placement.dim] += chunk_start(param.shape[placement.dim], mesh.size(mesh_dim),
                                                     mesh.get_local_rank(mesh_dim))
    return tuple(slice(start, start + size) for start, size in zip(starts, local.shape, strict=True))


def full_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    """The shape of the whole parameter (every TP and FSDP shard together)."""
    shape = list(param.shape)
    tp_dim = tensor_parallel_dim(param)
    if tp_dim is not None:
        shape[tp_dim] *= tp_size
    return torch.Size(shape)
