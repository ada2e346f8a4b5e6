"""Gradient SUM over the DP x CP group, bucketed and overlapped with the backward.

Every rank's loss is already divided by the global token count (``loss.py``), so the exact
gradient is the plain sum over DP x CP (DDP would average). Each parameter's ``.grad`` is a view
into a flat bucket buffer (like DDP's ``gradient_as_bucket_view``): autograd accumulates the
micro-batches into it in place, and during the last micro-batch's backward a bucket's
all-reduce starts as soon as all of its parameters' gradients are final.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: int = 0
    work: dist.Work | None = None
    views: list[torch.Tensor] = field(default_factory=list)


class GradientReducer:
    """Sums the gradients of ``parameters`` over ``group`` (DP x CP); TP-sharded parameters are reduced
    shard by shard (every rank of the group holds the same shard).

    Use ``zero_grad()`` instead of the optimizer's (it keeps ``.grad`` as bucket views), run every micro-batch's
    backward except the last one outside ``sync()``, the last one inside it; on leaving ``sync()`` every
    gradient holds the sum over the group.
    """

    def __init__(self, parameters: list[nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_mb: float = 25.0) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.params = [p for p in parameters if p.requires_grad]
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._active = False
        self._next = 0  # the next bucket to launch
        limit = max(1, int(bucket_mb * 2**20))
        pending: list[nn.Parameter] = []
        pending_bytes = 0
        for param in reversed(self.params):  # the backward produces the last layers' gradients first
            if pending and (param.dtype != pending[0].dtype or param.device != pending[0].device
                            or pending_bytes >= limit):
                self._add_bucket(pending)
                pending, pending_bytes = [], 0
            pending.append(param)
            pending_bytes += param.numel() * param.element_size()
        if pending:
            self._add_bucket(pending)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        bucket = _Bucket(params, buffer)
        offset = 0
        for param in params:
            bucket.views.append(buffer[offset: offset + param.numel()].view_as(param))
            offset += param.numel()
            self._bucket_of[id(param)] = bucket
        self.buckets.append(bucket)
        for param, view in zip(params, bucket.views, strict=True):
            param.grad = view

    def zero_grad(self) -> None:
        """Zero every bucket and point each ``.grad`` back at its view."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for param, view in zip(bucket.params, bucket.views, strict=True):
                if param.grad is not view:
                    param.grad = view

    @contextmanager
    def sync(self) -> Iterator[None]:
        """Reduce during the backward run inside; wait for every bucket on exit."""
        self._active = True
        try:
            yield
        finally:
            self._active = False
        self._finish()

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self._active or self.world == 1:
            return
        self._bucket_of[id(param)].ready += 1
        # launch in bucket order only, so that every rank issues the collectives in the same order
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        for param, view in zip(bucket.params, bucket.views, strict=True):
            if param.grad is not view:  # autograd replaced the tensor (e.g. set_to_none elsewhere)
                view.copy_(param.grad)
                param.grad = view
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._next += 1

    def _finish(self) -> None:
        if self.world == 1:
            return
        while self._next < len(self.buckets):  # parameters without a gradient in this backward
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
            bucket.ready, bucket.work = 0, None
        self._next = 0

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
