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
from cp_train.perf.inputs.documents import packed_document_ids

HEADS, KV_HEADS, DIM, BATCH = 4, 2, 8, 2


def count_attention(seqlen: int, layout: str, algorithm: str, documents: tuple[int, ...] | None = None
                    ) -> dict[str, Any]:
    """One fp32 forward + backward of causal CP attention on this rank's ``seqlen / world`` tokens (one document
    per sample, or the documents of ``documents``' lengths packed as ``cp_train.perf.inputs.documents`` packs them): the
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


# the collectives a dispatch mode sees, by op: (kind, index of the tensor argument whose bytes are the input)
COLLECTIVE_OPS = {"c10d::allreduce_": ("all_reduce", 0), "c10d::_allgather_base_": ("all_gather", 1),
                  "c10d::allgather_": ("all_gather", 1), "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
                  "_c10d_functional::all_reduce": ("all_reduce", 0),
                  "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
                  "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0)}


def count_tp_collectives(state: Any, config: Any) -> dict[str, list[int]]:
    """One fp32 forward + backward of the model of ``config`` with its loss on this rank (``run_with_parallel``):
    ``{kind: [calls, input bytes]}`` of every collective it issues (the CP attention op's body included)."""
    from cp_train.build import build_model
    from tests.dispatch_count import OpCounter

    seen: dict[str, list[int]] = {}

    def nbytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        return sum(nbytes(v) for v in value) if isinstance(value, (list, tuple)) else 0

    class Counting(OpCounter):  # every op, the CP attention op's body included; collectives recorded
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
            if func._schema.name in COLLECTIVE_OPS:
                kind, index = COLLECTIVE_OPS[func._schema.name]
                entry = seen.setdefault(kind, [0, 0])
                entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes(args[index])
            return super().__torch_dispatch__(func, types, args, kwargs)

    model, _ = build_model(config, state, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    n = config.data.seq_len // config.parallel.cp
    tokens, labels = (torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size, n),
                                    generator=generator) for _ in range(2))
    with Counting():
        model(tokens, labels=labels).sum().backward()
    return seen
