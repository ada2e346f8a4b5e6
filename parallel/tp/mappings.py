"""Megatron-style TP autograd mappings: copy to / reduce from / scatter to / gather from the TP region.

Each takes its TP ``group`` explicitly; ``group=None`` (or a group of size 1) is the identity, with no
communication. The forward of each is the backward of its pair (copy <-> reduce, scatter <-> gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cp_train.parallel.compat import functional_all_gather


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(size, rank)`` of this process in ``group``; ``(1, 0)`` for ``None``."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_divisible(what: str, value: int, size: int) -> None:
    if value % size != 0:
        raise ValueError(f"{what} = {value} is not divisible by the tensor-parallel size {size}; "
                         f"make {what} a multiple of {size} or change tp")



def _split_last_dim(x: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    check_divisible("last dimension", x.shape[-1], size)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    if torch.compiler.is_compiling():  # the traceable form: one gather along dim 0, then the parts side by side
        return torch.cat(functional_all_gather(x.contiguous(), 0, group).chunk(size), dim=-1)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def all_reduce_(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over ``group`` in place (``op``: sum or max) and returned; under ``torch.compile`` through
    the functional collectives, which the compiler traces (the in-place ``dist`` calls break the graph)."""
    if torch.compiler.is_compiling():
        return x.copy_(funcol.all_reduce(x, op, group))
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return x


def _all_reduced(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_reduce_(x.clone(memory_format=torch.contiguous_format), group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduced(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, (ctx.size, rank) = group, group_size_and_rank(group)
        return _split_last_dim(x, ctx.size, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad, ctx.group, ctx.size), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.size, ctx.rank = group_size_and_rank(group)
        return _gather_last_dim(x, group, ctx.size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last_dim(grad, ctx.size, ctx.rank), None


def _no_tp(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def copy_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over ``group`` backward."""
    return x if _no_tp(group) else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward."""
    return x if _no_tp(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim (``[..., d]`` -> ``[..., d/tp]``); all-gather backward."""
    return x if _no_tp(group) else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim in rank order (``[..., d/tp]`` -> ``[..., d]``); split backward."""
    return x if _no_tp(group) else _GatherFromRegion.apply(x, group)
