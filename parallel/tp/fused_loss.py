"""The LM head and its cross entropy fused, chunk by chunk of tokens: ``[tokens, vocab]`` logits never exist.

``linear_cross_entropy(x, weight, targets, group, chunk_tokens)`` is ``vocab_parallel_cross_entropy(x @
weight.T, targets, group)`` (``layers.py``) computed ``chunk_tokens`` rows at a time. The forward keeps only
each row's max and log-sum-exp (fp32, ``[tokens]``); the backward recomputes each chunk's logits from ``x``
and ``weight``, turns them into the chunk's gradient (softmax minus the one-hot target, times the loss's
gradient) and multiplies it straight into ``dx`` and ``dweight``. The transient is one chunk's logits, fp32:
``chunk_tokens x vocab/tp x 4`` bytes, instead of two ``[tokens, vocab/tp]`` tensors held from the forward
to the backward. The price: the head's forward matmul runs twice.

Under TP (``group``): ``weight`` is this rank's vocab shard ``[vocab/tp, hidden]`` (rank r holds classes
``[r*V/tp, (r+1)*V/tp)``); per chunk the row max and two per-row sums are all-reduced, and ``dx`` is this
rank's partial (the caller's ``copy_to_tensor_parallel_region`` sums it over TP). The matmuls run in the
dtype autocast gives the head (or ``x``'s without it), the softmax in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_train.parallel.tp.mappings import all_reduce_, group_size_and_rank


def _matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.promote_types(x.dtype,
                                                                                                        weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                group: dist.ProcessGroup | None, chunk_tokens: int, ignore_index: int) -> torch.Tensor:
        size, rank = group_size_and_rank(group)
        dtype = _matmul_dtype(x, weight)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        w = weight.to(dtype)
        local_vocab = w.shape[0]
        rows = x.shape[0]
        row_max = torch.empty(rows, dtype=acc, device=x.device)
        log_sum_exp = torch.empty_like(row_max)
        shaped = torch.empty(targets.shape, dtype=acc, device=x.device)  # returned whole: not a view (FSDP2 warns)
        loss, targets = shaped.view(-1), targets.reshape(-1)
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, rows, chunk_tokens):
                part = slice(start, min(start + chunk_tokens, rows))
                logits = F.linear(x[part].to(dtype), w).to(acc)
                chunk_max = logits.amax(dim=-1)
                if size > 1:
                    all_reduce_(chunk_max, group, "max")
                logits -= chunk_max.unsqueeze(-1)
                target = targets[part] - rank * local_vocab
                in_shard = (target >= 0) & (target < local_vocab) & (targets[part] != ignore_index)
                picked = logits.gather(-1, torch.where(in_shard, target, 0).unsqueeze(-1)).squeeze(-1)
                sums = torch.stack([torch.where(in_shard, picked, 0.0), logits.exp_().sum(dim=-1)])
                if size > 1:
                    all_reduce_(sums, group)
                row_max[part], log_sum_exp[part] = chunk_max, sums[1].log()
                loss[part] = torch.where(targets[part] == ignore_index, 0.0, log_sum_exp[part] - sums[0])
                del logits  # freed before the next chunk's matmul: one chunk's logits at a time
        ctx.save_for_backward(x, weight, targets, row_max, log_sum_exp)
        ctx.group, ctx.chunk_tokens, ctx.ignore_index, ctx.dtype = group, chunk_tokens, ignore_index, dtype
        return shaped

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, targets, row_max, log_sum_exp = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1)
        _, rank = group_size_and_rank(ctx.group)
        dtype, acc = ctx.dtype, row_max.dtype
        w = weight.to(dtype)
        local_vocab = w.shape[0]
        dx = torch.empty(x.shape, dtype=acc, device=x.device)
        dweight = torch.zeros(w.shape, dtype=acc, device=w.device)
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, x.shape[0], ctx.chunk_tokens):
                _chunk_grads(x, w, targets, grad_loss, row_max, log_sum_exp, slice(start, start + ctx.chunk_tokens),
                             rank * local_vocab, ctx.ignore_index, dx, dweight)
        return dx.to(x.dtype), dweight.to(weight.dtype), None, None, None, None


def _chunk_grads(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, grad_loss: torch.Tensor,
                 row_max: torch.Tensor, log_sum_exp: torch.Tensor, part: slice, vocab_start: int, ignore_index: int,
                 dx: torch.Tensor, dweight: torch.Tensor) -> None:
    """One chunk's backward: ``dx[part]`` written, ``dweight`` accumulated (both in the softmax's dtype)."""
    acc = row_max.dtype
    grad = F.linear(x[part].to(w.dtype), w).to(acc)
    grad = grad.sub_(row_max[part].unsqueeze(-1)).sub_(log_sum_exp[part].unsqueeze(-1)).exp_()  # the softmax
    ignored = targets[part] == ignore_index
    target = targets[part] - vocab_start
    in_shard = (target >= 0) & (target < w.shape[0]) & ~ignored
    grad.scatter_add_(-1, torch.where(in_shard, target, 0).unsqueeze(-1), -in_shard.to(acc).unsqueeze(-1))
    grad.mul_(torch.where(ignored, 0.0, grad_loss[part].to(acc)).unsqueeze(-1))
    grad = grad.to(w.dtype)
    dx[part] = grad @ w
    dweight += grad.t() @ x[part].to(w.dtype)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         group: dist.ProcessGroup | None = None, chunk_tokens: int = 1024,
                         ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy in ``targets``' shape (fp32; fp64 for fp64 inputs; a tensor of its own, not a
    view) of the logits ``x @ weight.T`` against global class ids ``targets`` (``N`` of them, any shape, row-major
    as ``x``'s rows), with ``x`` ``[N, hidden]`` and ``weight`` this TP rank's vocab shard
    ``[vocab/tp, hidden]``; ``chunk_tokens`` rows of logits at a time. Targets equal to ``ignore_index`` get
    loss 0 and no gradient; the others must lie in ``[0, vocab)`` (not checked)."""
    return _LinearCrossEntropy.apply(x, weight, targets, group, chunk_tokens, ignore_index)
