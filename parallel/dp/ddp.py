"""Gradients summed over the DP x CP group by DDP, and gradient accumulation under DDP or FSDP2.

The loss contract (``cp_train/loss.py``): every rank backpropagates its token-loss sum over the global token
count, so the exact gradient is the plain SUM over DP x CP. DDP averages by default: ``replicate_with_ddp``
registers a comm hook that all-reduces with SUM. ``gradient_sync(module, last)`` runs a micro-batch's backward
with or without the reduction (nothing is reduced until the last micro-batch: FSDP2 keeps the unsharded sum,
DDP its buckets).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from cp_train.parallel.mesh.collectives import note_failure


def _sum_all_reduce(group, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations: none, or its objects
    """DDP comm hook (a ``dist.GradBucket`` -> ``Future[Tensor]``): all-reduce the bucket with SUM (DDP's own
    hook divides by the group size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)

    def summed(future: torch.futures.Future) -> torch.Tensor:
        try:
            return future.value()[0]
        except Exception as error:  # DDP re-raises it wrapped: record which collective failed
            note_failure(error, "all_reduce", group)
            raise

    return work.get_future().then(summed)


def replicate_with_ddp(model: nn.Module, group: dist.ProcessGroup, bucket_mb: float) -> nn.Module:
    """``model`` under DDP over ``group`` (DP x CP) with a SUM of the gradients; ``model`` itself when the group
    has one rank (nothing to reduce)."""
    if dist.get_world_size(group) == 1:
        return model
    wrapped = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb,
                                      gradient_as_bucket_view=True)
    wrapped.register_comm_hook(group, _sum_all_reduce)
    return wrapped


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool, keep_gathered: bool = False) -> Iterator[None]:
    """Run one micro-batch's backward with (``enabled``: the last micro-batch) or without the DP x CP reduction.

    FSDP: the root's parameters (embedding, norm, head: gathered for the whole forward and backward anyway)
    stay gathered from one micro-batch to the next; with ``keep_gathered`` (no resharding after forward,
    ZeRO-2) every block's do too, so each is gathered once per step instead of once per micro-batch."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        module.set_reshard_after_backward(enabled, recurse=keep_gathered)
        yield
    elif isinstance(module, DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
    else:
        yield
