"""The loss reduction that is exact across DP x CP with masked tokens.

Contract (Megatron / torchtitan): count the loss tokens of the whole global batch first
(all-reduce over DP x CP), backpropagate ``sum(local token losses) / global_count`` on every rank,
SUM the gradients over DP x CP (DDP: ``cp_train.parallel.dp.ddp``; FSDP2: ``model/parallelize.py``), and
log ``all_reduce(sum of token losses) / global_count``. Averaging per rank and then over ranks is wrong
whenever ranks hold different numbers of loss tokens (EOD masking, padding, zigzag slices of unequal documents).

Everything a training step needs stays on the device (no host read, so nothing waits for the device); only
``reduce_sums`` returns host numbers (evaluation, once per pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``values`` summed in place over ``group`` (a group of one or None: unchanged); returns ``values``."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values


def on_device(values: Sequence[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """An fp64 vector on ``device`` of host numbers (each filled in by a kernel: no copy from pageable host
    memory, which would wait for the device) and scalar tensors already there."""
    return torch.stack([_scalar(v, device) for v in values])


def _scalar(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().double().reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def global_loss_tokens(loss_masks: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Loss tokens of the global batch (fp64 scalar on the masks' device, at least 1, not read to the host):
    this rank's ``loss_masks`` (one per micro-batch, ``[B, n_local]``) summed, then all-reduced over ``group``
    (DP x CP; TP ranks hold copies and are not counted)."""
    local = torch.stack([mask.double().sum() for mask in loss_masks]).sum().reshape(1)
    return all_reduce_sum(local, group)[0].clamp(min=1.0)


def host_sum(mask: torch.Tensor) -> float:
    """The sum of a CPU ``mask`` (a loss-token count), read through numpy: host memory, no device to wait for."""
    return float(mask.detach().double().numpy().sum())


def masked_loss_sum(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``sum(token_losses * loss_mask)`` of one micro-batch (fp32 scalar); both ``[B, n_local]``."""
    return (token_losses.float() * loss_mask.to(token_losses.device, torch.float32)).sum()


def reduce_loss(local_sum: torch.Tensor, global_tokens: torch.Tensor, group: dist.ProcessGroup | None
                ) -> torch.Tensor:
    """The global mean loss (fp64 scalar on the device, not read to the host): this rank's summed token
    losses all-reduced over ``group``, over ``global_tokens`` (``global_loss_tokens``)."""
    total = all_reduce_sum(local_sum.detach().double().reshape(1).clone(), group)
    return total[0] / global_tokens


def device_sums(values: Sequence[float | torch.Tensor], group: dist.ProcessGroup | None,
                device: torch.device) -> torch.Tensor:
    """Element-wise sum of small fp64 statistics (host numbers or scalars on ``device``, the backend's
    device) over ``group`` in one all-reduce, left on ``device`` (fp64 ``[len(values)]``, not read)."""
    return all_reduce_sum(on_device(values, device), group)


def reduce_sums(values: Sequence[float | torch.Tensor], group: dist.ProcessGroup | None,
                device: torch.device) -> list[float]:
    """``device_sums`` read to the host (one read for all)."""
    return device_sums(values, group, device).tolist()
