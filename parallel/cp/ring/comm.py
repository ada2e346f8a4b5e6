"""Point-to-point exchange with the ring neighbours of a CP group.

Each ``exchange`` posts one send to the next rank and one receive from the
previous rank with ``dist.batch_isend_irecv`` and returns at once; ``wait``
on the returned ``Transfer`` before reading the received tensor. Every rank
must post its exchanges in the same order (the ring attention does).

The K/V hops (``KV_TAG``) and the dK/dV hops (``GRAD_TAG``) go on two communicators over the same ranks where
the parallel state made a second one (``mesh/model_parallel.register_grad_group``; its NCCL streams at high
priority): NCCL runs a communicator's operations one after another, so on one communicator a K/V hop would
queue behind the dK/dV hop posted before it. Pairing stays NCCL's: the k-th send on a communicator with its k-th
receive, on each of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_train.parallel.mesh.model_parallel import grad_group_of

BYTES_SENT: Counter[int | str] = Counter()  # bytes this process sent: by ring tag, or by collective name
KV_TAG, GRAD_TAG = 0, 1  # what a hop carries: K/V blocks forward, dK/dV accumulators backward


def count_sent(kind: str, tensor: torch.Tensor, share: float) -> None:
    """Account ``share`` of ``tensor``'s bytes as sent by this rank in a ``kind`` collective (an all-gather
    sends its input to world-1 ranks: share world-1; an all-to-all or reduce-scatter (world-1)/world)."""
    BYTES_SENT[kind] += int(tensor.numel() * tensor.element_size() * share)


@dataclass
class Transfer:
    """An exchange in flight: ``recv`` holds the previous rank's tensors once ``wait()`` returns."""

    recv: list[torch.Tensor]
    works: list

    def wait(self) -> list[torch.Tensor]:
        """Wait for the sends and receives; hand over the received tensors (kept no longer here)."""
        for work in self.works:
            work.wait()
        received, self.recv, self.works = self.recv, [], []
        return received


class RingComm:
    """Ring neighbours of ``group`` (None: the default group), as global ranks."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.grad_group = grad_group_of(self.group)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, send: list[torch.Tensor], recv_shapes: list[torch.Size] | None = None,
                 tag: int = 0, like: torch.Tensor | None = None) -> Transfer:
        """Send the contiguous tensors ``send`` to the next rank; receive the previous rank's.

        The received tensors have ``recv_shapes`` (default: the shapes sent) and the dtype and
        device of ``like`` (default: the first tensor sent);
        either list may be empty (nothing sent or nothing received). The send buffers are
        released once the transfer completes.
        """
        shapes = recv_shapes if recv_shapes is not None else [x.shape for x in send]
        like = like if like is not None else (send[0] if send else None)
        recv = [torch.empty(shape, dtype=like.dtype, device=like.device) for shape in shapes]
        if not send and not recv:
            return Transfer([], [])
        BYTES_SENT[tag] += sum(x.numel() * x.element_size() for x in send)
        group = self.grad_group if tag == GRAD_TAG else self.group
        ops = [dist.P2POp(dist.isend, x, self.next, group, tag) for x in send]
        ops += [dist.P2POp(dist.irecv, x, self.prev, group, tag) for x in recv]
        return Transfer(recv, dist.batch_isend_irecv(ops))
