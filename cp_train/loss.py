"""The loss reduction that is exact across DP x CP with masked tokens.

Contract (Megatron / torchtitan): count the loss tokens of the whole global batch first
(all-reduce over DP x CP), backpropagate ``sum(local token losses) / global_count`` on every rank,
SUM the gradients over DP x CP (DDP: ``cp_train.parallel.dp.ddp``; FSDP2: ``model/parallelize.py``), and
log ``all_reduce(sum of token losses) / global_count``. Averaging per rank and then over ranks is wrong
whenever ranks hold different numbers of loss tokens (EOD masking, padding, zigzag slices of unequal documents).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _all_reduce(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values


def global_loss_tokens(loss_masks: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> float:
    """Loss tokens of the global batch: this rank's ``loss_masks`` (one per micro-batch, ``[B, n_local]``)
    summed, then all-reduced over ``group`` (DP x CP; TP ranks hold copies and are not counted). At least 1."""
    local = torch.stack([mask.double().sum() for mask in loss_masks]).sum().reshape(1)
    return max(float(_all_reduce(local, group)[0]), 1.0)


def masked_loss_sum(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``sum(token_losses * loss_mask)`` of one micro-batch (fp32 scalar); both ``[B, n_local]``."""
    return (token_losses.float() * loss_mask.to(token_losses.device, torch.float32)).sum()


def reduce_loss(local_sum: torch.Tensor, global_tokens: float, group: dist.ProcessGroup | None) -> float:
    """The global mean loss: this rank's summed token losses (fp64 scalar) all-reduced over ``group`` / count."""
    total = _all_reduce(local_sum.detach().double().reshape(1).clone(), group)
    return float(total[0]) / global_tokens


def reduce_sums(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    """Element-wise sum of small fp64 statistics over ``group`` in one all-reduce (tensors on ``device``,
    the backend's device)."""
    return _all_reduce(torch.tensor(values, dtype=torch.float64, device=device), group).tolist()
