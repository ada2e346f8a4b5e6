"""Point-to-point exchange with the ring neighbours of a CP group.

Each ``exchange`` posts one send to the next rank and one receive from the
previous rank with ``dist.batch_isend_irecv`` and returns at once; ``wait``
on the returned ``Transfer`` before reading the received tensor. Every rank
must post its exchanges in the same order (the ring attention does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Transfer:
    """An exchange in flight: ``recv`` holds the previous rank's tensor once ``wait()`` returns."""

    recv: torch.Tensor
    works: list

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        return self.recv


class RingComm:
    """Ring neighbours of ``group`` (None: the default group), as global ranks."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor | None = None, tag: int = 0) -> Transfer:
        """Send ``send`` to the next rank and receive the previous rank's tensor (same shape) into ``recv``."""
        if recv is None:
            recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return Transfer(recv, dist.batch_isend_irecv(ops))
