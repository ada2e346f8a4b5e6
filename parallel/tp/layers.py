"""Megatron-style tensor-parallel (TP) layers: column- and row-parallel linear, vocab-parallel embedding and
cross entropy (the mappings they use are in ``mappings.py``).

Every function and layer takes its TP ``group`` explicitly; ``group=None`` (or a group of
size 1) means no TP: the layers are then plain ``Linear`` / ``Embedding`` layers and the
mappings are identities, with no communication.

Weight initialisation does not depend on the layout: the FULL weight is drawn from a
``torch.Generator`` seeded with ``seed`` (fp32, on CPU) and each rank keeps its slice, so a
model built with tp=1 and with tp=4 holds the same numbers. Give each layer its own seed.
Partitioned parameters carry ``tensor_model_parallel = True`` and ``partition_dim``.

``sequence_parallel=True`` (at tp > 1; ``sequence_parallel.py``): the layer's replicated side is sharded along
the sequence (dim 1 of ``[B, n, ...]``): the column-parallel input and the row-parallel output and the
embedding's output are this rank's ``[B, n/tp, ...]``, with all-gather / reduce-scatter in place of the
identity / all-reduce.

The column- and row-parallel layers run their local matmul through ``linear_fn`` (``F.linear``, with its
contract); ``fp8.py`` replaces it with an FP8 matmul, keeping the layer's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_train.parallel.tp.mappings import (
    all_reduce_,
    check_divisible,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_size_and_rank,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from cp_train.parallel.tp.sequence_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

InitMethod = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a full fp32 weight in place, drawing only from the given generator."""
LinearFn = Callable[..., torch.Tensor]
"""A layer's local matmul ``(x, weight, bias=None) -> y``, ``F.linear``'s contract (``fp8.py``: FP8's)."""


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear on ``x`` computes in: autocast's when it is on for ``x``'s device, else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def init_weight_shard(full_shape: tuple[int, int], partition_dim: int, group: dist.ProcessGroup | None,
                      seed: int, init_method: InitMethod | None = None, init_std: float = 0.02,
                      dtype: torch.dtype | None = None, device: torch.device | str | None = None
                      ) -> torch.Tensor:
    """This rank's slice (along ``partition_dim``) of the full weight drawn from ``seed``.

    Default init: normal(0, ``init_std``). Layout independent: the slices of all ranks
    concatenate to the full weight that tp=1 would hold.
    """
    size, rank = group_size_and_rank(group)
    check_divisible(f"weight dim {partition_dim} of {tuple(full_shape)}", full_shape[partition_dim], size)
    generator = torch.Generator().manual_seed(seed)
    full = torch.empty(full_shape, dtype=torch.float32)
    if full.is_meta:  # a meta build (``model/meta.py``) has no values to draw: ``materialize`` draws them later
        pass
    elif init_method is None:
        full.normal_(0.0, init_std, generator=generator)
    else:
        init_method(full, generator)
    shard = full.chunk(size, dim=partition_dim)[rank].clone()
    return shard.to(dtype=dtype or torch.get_default_dtype(), device=device)


def _partitioned(tensor: torch.Tensor, partition_dim: int) -> nn.Parameter:
    param = nn.Parameter(tensor)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by output rows across ``group``.

    Local weight ``[out_features/tp, in_features]`` and bias ``[out_features/tp]`` (rank r
    holds rows ``[r*out/tp, (r+1)*out/tp)``). Input ``[..., in_features]`` (replicated);
    output ``[..., out_features/tp]``, or ``[..., out_features]`` when ``gather_output``. With
    ``sequence_parallel`` the input is this rank's ``[B, n/tp, in_features]``, all-gathered to ``[B, n, ...]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: dist.ProcessGroup | None = None, seed: int = 0, init_method: InitMethod | None = None,
                 init_std: float = 0.02, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.tp_size, self.tp_rank = group_size_and_rank(group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        check_divisible("out_features", out_features, self.tp_size)
        self.weight = _partitioned(init_weight_shard((out_features, in_features), 0, group, seed,
                                                     init_method, init_std, dtype, device), 0)
        local_out = out_features // self.tp_size
        self.bias = (_partitioned(torch.zeros(local_out, dtype=self.weight.dtype, device=device), 0)
                     if bias else None)
        self.linear_fn: LinearFn = F.linear  # the local matmul (fp8.py: FP8's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (gather_from_sequence_parallel_region(x, self.group) if self.sequence_parallel
             else copy_to_tensor_parallel_region(x, self.group))
        y = self.linear_fn(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by input columns across ``group``; output all-reduced.

    Local weight ``[out_features, in_features/tp]`` (rank r holds columns
    ``[r*in/tp, (r+1)*in/tp)``); bias ``[out_features]`` replicated, added after the reduce.
    Input ``[..., in_features/tp]`` when ``input_is_parallel``, else ``[..., in_features]``
    (split here). Output ``[..., out_features]``, identical on every rank of ``group``; with
    ``sequence_parallel`` (``input_is_parallel`` only) this rank's ``[B, n/tp, out_features]`` of it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, group: dist.ProcessGroup | None = None, seed: int = 0,
                 init_method: InitMethod | None = None, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.tp_size, self.tp_rank = group_size_and_rank(group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel takes the TP-sharded input: set "
                             "input_is_parallel=True")
        check_divisible("in_features", in_features, self.tp_size)
        self.weight = _partitioned(init_weight_shard((out_features, in_features), 1, group, seed,
                                                     init_method, init_std, dtype, device), 1)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=self.weight.dtype, device=device))
                     if bias else None)
        self.linear_fn: LinearFn = F.linear  # the local matmul (fp8.py: FP8's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local_in = self.in_features // self.tp_size
        if self.input_is_parallel and x.shape[-1] != local_in:
            raise ValueError(f"input_is_parallel expects the last dim to be in_features/tp = {local_in}, "
                             f"got {x.shape[-1]}; pass the local shard or input_is_parallel=False")
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.sequence_parallel:  # each rank's bias gradient covers its shard: summed over TP
            y = reduce_scatter_to_sequence_parallel_region(self.linear_fn(x, self.weight), self.group)
            return y if self.bias is None else y + copy_to_tensor_parallel_region(self.bias, self.group)
        y = reduce_from_tensor_parallel_region(self.linear_fn(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into contiguous ranges across ``group``.

    Local weight ``[num_embeddings/tp, embedding_dim]`` (rank r holds ids
    ``[r*V/tp, (r+1)*V/tp)``). Input ids ``[...]`` in ``[0, num_embeddings)`` (not checked:
    an id outside every range embeds to zeros); output ``[..., embedding_dim]`` on every rank, or with
    ``sequence_parallel`` (ids ``[B, n]``) this rank's ``[B, n/tp, embedding_dim]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None = None,
                 seed: int = 0, init_method: InitMethod | None = None, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.tp_size, self.tp_rank = group_size_and_rank(group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        check_divisible("num_embeddings", num_embeddings, self.tp_size)
        self.weight = _partitioned(init_weight_shard((num_embeddings, embedding_dim), 0, group, seed,
                                                     init_method, init_std, dtype, device), 0)
        self.vocab_start = self.tp_rank * (num_embeddings // self.tp_size)
        self.vocab_end = self.vocab_start + num_embeddings // self.tp_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"token ids must be an integer tensor, got {ids.dtype}")
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.group)
        return reduce_from_tensor_parallel_region(y, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Eager, the forward saves the fp32 softmax and the backward turns it into the gradient in place (fewest
    passes over the logits; one backward per forward). Compiled, it saves the logits as given (bf16 under
    autocast) with the row max and the shifted row's log-sum-exp, and the backward recomputes the softmax:
    the compiler fuses each direction into one pass, and the saved tensor is the logits, not a copy."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                ignore_index: int) -> torch.Tensor:
        size, rank = group_size_and_rank(group)
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        local_vocab = logits.shape[-1]
        row_max = logits.detach().amax(dim=-1).to(compute_dtype)
        if size > 1:
            all_reduce_(row_max, group, "max")
        shifted = logits.to(compute_dtype) - row_max.unsqueeze(-1)  # a new tensor: the input is untouched
        ignored = targets == ignore_index
        local_target = targets - rank * local_vocab
        in_shard = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        index = torch.where(in_shard, local_target, 0).unsqueeze(-1)
        target_logit = torch.where(in_shard, shifted.gather(-1, index).squeeze(-1), 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])  # one all-reduce for both
        if size > 1:
            all_reduce_(sums, group)
        target_logit, sum_exp = sums.unbind(0)
        log_sum_exp = torch.log(sum_exp)
        loss = torch.where(ignored, 0.0, log_sum_exp - target_logit)
        ctx.logits_dtype, ctx.used, ctx.recompute = logits.dtype, False, torch.compiler.is_compiling()
        if ctx.recompute:
            ctx.save_for_backward(logits.detach(), row_max, log_sum_exp, index, in_shard, ignored)
        else:
            ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), None, None, index, in_shard, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.used:
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward pass per forward "
                               "(the saved softmax becomes the gradient in place); run the forward again")
        saved, row_max, log_sum_exp, index, in_shard, ignored = ctx.saved_tensors
        if not ctx.recompute:  # eager: the saved softmax becomes the gradient
            ctx.used, grad = True, saved
        else:  # the max first, as in the forward: exact for large logits, where their sum is not
            grad = torch.exp(saved.to(row_max.dtype) - row_max.unsqueeze(-1) - log_sum_exp.unsqueeze(-1))
        grad.scatter_add_(-1, index, -in_shard.to(grad.dtype).unsqueeze(-1))
        grad.mul_(torch.where(ignored, 0.0, grad_loss.to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: dist.ProcessGroup | None = None, ignore_index: int = -100
                                 ) -> torch.Tensor:
    """Per-token cross entropy ``[...]`` of vocab-sharded ``logits`` ``[..., V/tp]`` (rank r holds
    classes ``[r*V/tp, (r+1)*V/tp)``) against global class ids ``targets`` ``[...]``.

    The full logits are never gathered: only the row max and two per-token sums are
    all-reduced over ``group``. Computed in fp32 (fp64 for fp64 logits); the loss has that
    dtype, the gradient the logits' dtype. Tokens whose target is ``ignore_index`` get loss 0
    and no gradient. Targets must lie in ``[0, V)`` (not checked). One backward per forward (eager).
    """
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of class ids, got {targets.dtype}")
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal the logits shape without its "
                         f"last (vocab) dim, {tuple(logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)
