"""Per-rank functions for ``test_planner.py``: what the CP attention really computes and sends, counted.

Called as ``world.run(count_attention, ...)`` on every rank of a spawned gloo world that is the CP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cp_train.data.loader import rank_positions
from cp_train.parallel.cp.attention import build_cp_plan, context_parallel_attention
from cp_train.parallel.cp.ring import comm as ring_comm
from cp_train.parallel.kernels import torch_ops
from cp_train.plan.inputs.documents import packed_document_ids

HEADS, KV_HEADS, DIM, BATCH = 4, 2, 8, 2


def count_attention(seqlen: int, layout: str, algorithm: str, documents: tuple[int, ...] | None = None
                    ) -> dict[str, Any]:
    """One fp32 forward + backward of causal CP attention on this rank's ``seqlen / world`` tokens (one document
    per sample, or the documents of ``documents``' lengths packed as ``cp_train.plan.inputs.documents`` packs them): the
    forward kernel area (query-key pairs times heads and samples) and the bytes sent, by tag."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = seqlen // world
    generator = torch.Generator().manual_seed(rank)
    q = torch.randn(BATCH, n, HEADS, DIM, generator=generator, requires_grad=True)
    k, v = (torch.randn(BATCH, n, KV_HEADS, DIM, generator=generator, requires_grad=True) for _ in range(2))
    if documents:
        docs = packed_document_ids(documents, seqlen)
        index = rank_positions(docs, world, layout)[rank, 0]
        mask = {"document_ids": docs[:, index].expand(BATCH, n), "position_ids": index.expand(BATCH, n)}
    else:
        mask = {"plan": build_cp_plan(dist.group.WORLD, layout, True, n, algorithm=algorithm)}
    area = [0]
    original = torch_ops.TorchCpuFlash.forward

    def counting_forward(self, q, k, v, causal, scale):  # noqa: ANN001, ANN202 - the kernel's own signature
        rows, keys = q.shape[1], k.shape[1]  # causal: the last query sees every key (bottom-right aligned)
        area[0] += q.shape[0] * q.shape[2] * (rows * (keys - rows) + rows * (rows + 1) // 2 if causal
                                              else rows * keys)
        return original(self, q, k, v, causal, scale)

    ring_comm.BYTES_SENT.clear()
    torch_ops.TorchCpuFlash.forward = counting_forward
    try:
        out = context_parallel_attention(q, k, v, dist.group.WORLD, layout, True, backend="torch",
                                         algorithm=algorithm, **mask)
        out.backward(torch.ones_like(out))
    finally:
        torch_ops.TorchCpuFlash.forward = original
    return {"area": area[0], "sent": dict(ring_comm.BYTES_SENT), "rank": dist.get_rank()}
