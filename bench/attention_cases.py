"""Rank-side timed attention cases for ``bench/attention.py`` (run in spawned gloo worlds).

A case is ``"local"`` (the whole sequence in one process: PyTorch's SDPA for one document, the local
kernel on the same mask for packed documents), ``"<algorithm>:<layout>"`` (``context_parallel_attention``
with that CP algorithm; hybrid uses Ulysses groups of ``ulysses`` ranks) or ``"torch_cp"`` (PyTorch's own
ring, ``_templated_ring_attention`` with all-to-all rotation, on zigzag shards; one document only).
Plans are built before the timed iterations, as the model builds one per batch for all its layers.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import median, peak_memory_mb, reset_peak_memory
from cp_train.parallel.cp.attention import as_groups, attend, build_cp_plan
from cp_train.parallel.cp.balanced_layout import balanced_positions
from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.cp.plan.window_plan import kv_rows_received
from cp_train.parallel.cp.ring.comm import BYTES_SENT
from cp_train.parallel.cp.spec import build_spec
from cp_train.parallel.mesh.model_parallel import CPGroups
from cp_train.parallel.mesh.rank_groups import compute_rank_groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def document_ids(spec: str, batch: int, seqlen: int) -> torch.Tensor:
    """``[batch, seqlen]``: ``"1"`` one document; an integer: random lengths of that mean; ``"corpus"``:
    the embedded corpus's documents as the trainer packs them."""
    if spec == "1":
        return torch.zeros(batch, seqlen, dtype=torch.int64)
    if spec == "corpus":
        from cp_train.data.default_corpus import prepare_default_corpus
        from cp_train.data.gpt_dataset import GPTDataset
        from cp_train.data.indexed import IndexedDataset

        dataset = GPTDataset(IndexedDataset(prepare_default_corpus().data_prefix), seqlen, batch, seed=1234)
        return torch.stack([dataset[i]["document_ids"] for i in range(batch)])
    rng = np.random.default_rng(int(spec))
    rows = []
    for _ in range(batch):
        starts = rng.random(seqlen) < 1.0 / int(spec)
        starts[0] = False
        rows.append(torch.from_numpy(np.cumsum(starts)))
    return torch.stack(rows)


def _positions(layout: str, docs: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if layout == "balanced":
        return torch.stack([balanced_positions(row, world)[rank] for row in docs])
    return sequence_positions(docs.shape[1], rank, world, layout).expand(docs.shape[0], -1)


def _torch_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """PyTorch's templated ring attention on the CPU flash kernel, through autograd ([B, S, H, D] in/out)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
        set_rotate_method,
    )

    set_rotate_method("alltoall")
    group = dist.group.WORLD
    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    class TorchRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = _templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=causal, dropout_p=0.0)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return _templated_ring_attention_backward(group, 2, backward_op, dout, "grad_out", q, k, v, out, lse,
                                                      is_causal=causal, dropout_p=0.0)[:3]

    return TorchRing.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class TimedKernel:
    """An attention kernel that adds the seconds spent in its calls to ``seconds`` (everything else delegated)."""

    TIMED = ("forward", "backward", "varlen_forward", "varlen_backward")

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.seconds = kernel, 0.0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.kernel, name)
        if name not in self.TIMED:
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def _groups(algorithm: str, ulysses: int) -> CPGroups:
    """The world as the CP group (with hybrid's Ulysses and ring subgroups)."""
    if algorithm != "hybrid":
        return CPGroups(dist.group.WORLD)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = compute_rank_groups(world, 1, world, 1, ulysses)
    mine = {}
    for kind in ("cp_ulysses", "cp_ring"):
        for ranks in getattr(layout, kind):  # every rank creates every group, in the same order
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[kind] = group
    return CPGroups(dist.group.WORLD, mine["cp_ulysses"], mine["cp_ring"])


def time_case(case: str, shape: dict[str, Any], documents: str, fwd_only: bool, warmup: int,
              repeats: int, head_chunks: int | None = None, ulysses: int = 2) -> dict:
    """Time ``case`` on every rank; ``shape`` has batch, seqlen, heads, kv_heads, head_dim, dtype, causal and
    optionally ``window`` (W keys including the query; None or 0: unbounded)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    batch, seqlen, causal = shape["batch"], shape["seqlen"], shape["causal"]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(batch, seqlen, h, shape["head_dim"], generator=gen, dtype=DTYPES[shape["dtype"]])
            for h in (shape["heads"], shape["kv_heads"], shape["kv_heads"], shape["heads"])]
    docs = document_ids(documents, batch, seqlen)
    algorithm, _, layout = case.partition(":")
    layout = layout or ("zigzag" if case == "torch_cp" else "contiguous")
    positions = _positions(layout, docs, rank, world) if case != "local" else torch.arange(seqlen).expand(batch, -1)
    local = [torch.gather(x, 1, positions[:, :, None, None].expand(-1, -1, *x.shape[2:])) for x in full]
    del full
    q, k, v, dout = local
    group = _groups(algorithm, ulysses) if ":" in case else None
    one_document = documents == "1"
    window = shape.get("window") or None
    masked = not one_document or layout == "balanced"  # the balanced layout always follows the documents
    plan = None if case == "torch_cp" or (case == "local" and one_document and window is None) else build_cp_plan(
        group, layout, causal, positions.shape[1], torch.gather(docs, 1, positions) if masked else None,
        positions if masked else None, algorithm if ":" in case else "ring", window=window)
    for x in (q, k, v):
        x.requires_grad_(not fwd_only)
    ours = case != "torch_cp" and not (case == "local" and one_document and window is None)
    spec, timed = None, None
    if ours:  # our own call path: time its kernel calls too
        spec = build_spec(q.device, q.dtype, q.shape[0], q.shape[2], k.shape[2], q.shape[-1],
                          algorithm=algorithm if ":" in case else "ring", layout=layout, causal=causal,
                          head_chunks=head_chunks, plan=plan)
        timed = TimedKernel(spec.kernel)
        spec = dataclasses.replace(spec, kernel=timed)

    def step() -> None:
        with torch.set_grad_enabled(not fwd_only):
            if case == "torch_cp":
                out = _torch_cp(q, k, v, causal)
            elif case == "local" and one_document:
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
                out = out.transpose(1, 2)
            else:
                out, _ = attend(q, k, v, as_groups(group), spec, plan)  # the model's path: built once, no checks
            if not fwd_only:
                out.backward(dout)
        for x in (q, k, v):
            x.grad = None

    times, kernel_times, added, sent = [], [], [], 0
    for index in range(warmup + repeats):
        if world > 1:
            dist.barrier()
        base = reset_peak_memory()
        before = sum(BYTES_SENT.values())
        if timed is not None:
            timed.seconds = 0.0
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if index >= warmup:
            times.append(elapsed)
            if timed is not None:
                kernel_times.append(timed.seconds)
            added.append(peak_memory_mb() - base)
            sent = sum(BYTES_SENT.values()) - before
    area = None if plan is None else sum(plan.areas) * batch ** (not plan.packed)
    return {"times": times, "kernel_times": kernel_times, "added_mb": median(added), "area": area,
            "sent_mb": sent / 2**20, "imbalance": None if plan is None else plan.imbalance,
            "kv_rows": kv_rows_received(plan, positions.shape[1]) if world > 1 else 0}
