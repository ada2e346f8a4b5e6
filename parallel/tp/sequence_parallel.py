"""Megatron's sequence parallelism (SP) over the TP group: the mappings between the sequence-sharded region
(each TP rank holds ``[B, n/tp, hidden]``: its contiguous 1/tp of the local tokens) and the TP region (every
rank holds all ``n`` tokens), and the norm whose weight sees only a shard.

- ``gather_from_sequence_parallel_region``: all-gather along the sequence before a column-parallel layer;
  its backward reduce-scatters (sums) the gradient back to the shards.
- ``reduce_scatter_to_sequence_parallel_region``: the row-parallel layer's partial sums, summed over TP and
  cut along the sequence; its backward all-gathers.
- ``sequence_parallel_norm``: a norm over a shard whose weight gradient is summed over TP (each rank saw
  1/tp of the tokens), so the replicated weight stays replicated.

The collectives run along dim 0 of a ``[n, B, hidden]`` view, so at B = 1 (long context) nothing is copied.
Each takes its TP ``group`` explicitly; the caller (``ModelParallel.sequence_parallel``) uses them only at
tp > 1, and the local length ``n`` must be divisible by tp (checked once, at the model's boundary).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_train.parallel.compat import (
    all_gather_single,
    functional_all_gather,
    functional_reduce_scatter,
    reduce_scatter_single,
)
from cp_train.parallel.tp.mappings import copy_to_tensor_parallel_region


def _all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, m, ...]`` of each rank -> ``[B, size*m, ...]`` in rank order."""
    front = x.transpose(0, 1).contiguous()
    if torch.compiler.is_compiling():
        gathered = functional_all_gather(front, 0, group)
    else:
        gathered = front.new_empty((dist.get_world_size(group) * front.shape[0], *front.shape[1:]))
        all_gather_single(gathered, front, group=group)
    return gathered.transpose(0, 1).contiguous()


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, n, ...]`` partial sums of each rank -> this rank's ``[B, n/size, ...]`` of their sum."""
    front = x.transpose(0, 1).contiguous()
    if torch.compiler.is_compiling():
        shard = functional_reduce_scatter(front, "sum", 0, group)
    else:
        shard = front.new_empty((front.shape[0] // dist.get_world_size(group), *front.shape[1:]))
        reduce_scatter_single(shard, front, group=group)
    return shard.transpose(0, 1).contiguous()


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_sequence(grad, ctx.group), None


def gather_from_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, n/tp, ...]`` shards -> ``[B, n, ...]`` on every rank of ``group``; reduce-scatter (sum) backward."""
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, n, ...]`` partial sums -> this rank's ``[B, n/tp, ...]`` of their sum; all-gather backward."""
    return _ReduceScatterToSequenceRegion.apply(x, group)


def sequence_parallel_norm(norm: nn.Module, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``norm(x)`` for ``x`` a sequence shard, with the gradient of ``norm.weight`` (its one parameter) summed over
    ``group``. ``nn.RMSNorm`` is applied directly; any other norm (apex's) through ``functional_call``."""
    weight = copy_to_tensor_parallel_region(norm.weight, group)
    if isinstance(norm, nn.RMSNorm):
        return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)
    return torch.func.functional_call(norm, {"weight": weight}, (x,))
