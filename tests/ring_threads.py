"""The ring's code path with ``world`` ranks as threads of one process, on any device.

One GPU cannot hold two NCCL ranks, so the GPU suite runs the ring's CUDA code (kernels, merges,
accumulators, transfer trimming, the overlap policy) with every rank a thread and the point-to-point
exchange replaced by queues. The same harness runs on CPU in the default suite, which keeps it honest.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from cp_train.parallel.cp.layout import sequence_positions, shard_sequence, unshard_sequence
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents, plan_for_layout
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.spec import AttentionSpec


@dataclass
class _Transfer:
    """What ``RingComm.exchange`` returns: ``wait()`` hands over the received tensors."""

    inbox: queue.Queue | None
    count: int

    def wait(self) -> list[torch.Tensor]:
        if not self.count:
            return []
        received = self.inbox.get(timeout=120)
        if received is _PEER_FAILED:
            raise _PeerFailed("another rank failed")
        return received


class _PeerFailed(RuntimeError):
    """Raised in a rank whose peer failed (the peer's own error is the one reported)."""


_PEER_FAILED = object()  # put in every inbox when a rank fails, so no rank waits for it


class ThreadRingComm:
    """Rank ``rank`` of a ring of ``world`` threads: sends are copies put in the next rank's inbox."""

    def __init__(self, rank: int, world: int, inboxes: dict[tuple[int, int], queue.Queue]) -> None:
        self.rank, self.world, self.inboxes = rank, world, inboxes

    def exchange(self, send: list[torch.Tensor], recv_shapes=None, tag: int = 0, like=None) -> _Transfer:
        if send:
            self.inboxes[(self.rank + 1) % self.world, tag].put([x.clone() for x in send])
        expected = len(recv_shapes) if recv_shapes is not None else len(send)
        return _Transfer(self.inboxes[self.rank, tag], expected)


def run_threaded_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, world: int,
                      spec: AttentionSpec, documents: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Forward and backward of the full-sequence inputs over ``world`` thread ranks in ``spec.layout``
    (``documents`` [B, S]: per-document masks); returns out, lse ([B, H, S]), dq, dk, dv of the whole
    sequence (accumulator dtype)."""
    seqlen = q.shape[1]
    if documents is not None:
        docs = torch.stack([shard_sequence(documents, r, world, spec.layout) for r in range(world)])
        positions = torch.stack([sequence_positions(seqlen, r, world, spec.layout) for r in range(world)])
        positions = positions[:, None].expand_as(docs)
    inboxes = {(rank, tag): queue.Queue() for rank in range(world) for tag in (0, 1)}
    results: list[dict | BaseException] = [{} for _ in range(world)]

    def rank_main(rank: int) -> None:
        try:
            local = [shard_sequence(x, rank, world, spec.layout) for x in (q, k, v, dout)]
            comm = ThreadRingComm(rank, world, inboxes) if world > 1 else None
            if documents is None:
                plan = plan_for_layout(spec.layout, spec.causal, world, rank, seqlen // world)
            else:
                plan = plan_for_documents(docs, positions, rank, spec.causal)
            out, lse = ring_forward(*local[:3], comm, spec, plan)
            dq, dk, dv = ring_backward(local[3], *local[:3], out.to(q.dtype), lse, comm, spec, plan)
            results[rank] = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            results[rank] = error
            for inbox in inboxes.values():
                inbox.put(_PEER_FAILED)

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"ring-rank-{rank}") for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if not isinstance(e, _PeerFailed)), errors[0])
    full = {name: unshard_sequence([r[name] for r in results], spec.layout) for name in results[0]}
    full["lse"] = full["lse"].transpose(1, 2)
    return full
