"""Rank-side checks of per-document attention, run inside spawned gloo worlds (test_document_attention.py).

Every rank builds the same full-sequence inputs and documents from a seed, runs the ring on its slice
(any layout, ``balanced`` included: positions then follow each sample's documents), gathers the
results back by position and compares them with a float64 reference of the whole sequence under the
block-diagonal (causal) mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.attention import build_cp_plan, context_parallel_attention
from cp_train.parallel.cp.balanced_layout import balanced_positions
from cp_train.parallel.cp.dropins_varlen import ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_func
from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.cp.ring import comm as ring_comm
from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.torch_ops import expand_kv
from tests.numerics import rel_err
from tests.ring_cases import counting_kernels

SPECS = ("one", "random", "single_tokens", "chunk_bounds", "spanning", "short")


def documents(spec: str, batch: int, seqlen: int, world: int, seed: int) -> torch.Tensor:
    """Document ids ``[batch, seqlen]`` (non-decreasing), different in every row, shaped by ``spec``."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        starts = torch.zeros(seqlen, dtype=torch.bool)
        if spec == "random":
            starts = torch.rand(seqlen, generator=gen) < 4.0 / seqlen
        elif spec == "single_tokens":  # documents of one token among longer ones
            starts = torch.rand(seqlen, generator=gen) < 0.3
            starts[seqlen // 2: seqlen // 2 + 3] = True
        elif spec == "chunk_bounds":  # every boundary on a zigzag chunk or rank boundary
            chunk = seqlen // (2 * world)
            starts[::chunk * (1 + b)] = True
        elif spec == "spanning":  # one document over every rank, short ones around it
            starts[[1 + b, seqlen - 2 - b]] = True
        elif spec == "short":  # everything shorter than a chunk
            starts[:: 2 + b] = True
        starts[0] = False
        rows.append(torch.cumsum(starts.long(), 0) + 5 * b)
    return torch.stack(rows)


def masked_reference(q, k, v, dout, docs, causal: bool, scale: float) -> dict[str, torch.Tensor]:
    """float64 out, lse [B, H, S], dq, dk, dv of the whole sequence under the per-document mask."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    heads = q.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, expand_kv(k64, heads)) * scale
    visible = docs[:, :, None] == docs[:, None, :]
    if causal:
        visible = visible & torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), expand_kv(v64, heads))
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return {"out": out.detach(), "lse": torch.logsumexp(scores, -1).detach(), "dq": dq, "dk": dk, "dv": dv}


def layout_positions(layout: str, docs: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``[B, n]`` global positions rank ``rank`` holds in ``layout`` (per sample for ``balanced``)."""
    batch, seqlen = docs.shape
    if layout == "balanced":
        return torch.stack([balanced_positions(docs[b], world)[rank] for b in range(batch)])
    return sequence_positions(seqlen, rank, world, layout).expand(batch, -1)


def _take(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    index = positions.view(*positions.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return torch.gather(x, 1, index)


def gather_by_position(local: torch.Tensor, positions: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Every rank's ``local`` [B, n, ...] put back at its ``positions`` [B, n]: the full [B, S, ...]."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    parts = [torch.empty_like(local) for _ in range(world)]
    where = [torch.empty_like(positions) for _ in range(world)]
    if world > 1:
        dist.all_gather(parts, local.contiguous())
        dist.all_gather(where, positions.contiguous())
    else:
        parts, where = [local], [positions]
    full = local.new_zeros(local.shape[0], seqlen, *local.shape[2:])
    for part, pos in zip(parts, where, strict=True):
        full.scatter_(1, pos.view(*pos.shape, *([1] * (part.dim() - 2))).expand_as(part), part)
    return full


def run_documents(q, k, v, dout, docs, layout: str, causal: bool, scale: float = 0.25,
                  head_chunks: int | None = None, algorithm: str = "ring", group=None,
                  masked: bool = True) -> dict[str, torch.Tensor]:
    """This rank's slice through ``context_parallel_attention`` (with ``document_ids`` when ``masked``, over
    ``group``: default the whole world); the full results."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if group is None:
        group = dist.group.WORLD if dist.is_initialized() else None
    positions = layout_positions(layout, docs, rank, world)
    local = [_take(x, positions).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    out, lse = context_parallel_attention(*local[:3], group, layout, causal, scale, return_lse=True,
                                          head_chunks=head_chunks, algorithm=algorithm,
                                          document_ids=_take(docs, positions) if masked else None,
                                          position_ids=positions if masked else None)
    out.backward(local[3])
    got = {"out": out.detach(), "lse": lse.transpose(1, 2).contiguous(), "dq": local[0].grad,
           "dk": local[1].grad, "dv": local[2].grad}
    full = {name: gather_by_position(x, positions, q.shape[1]) for name, x in got.items()}
    full["lse"] = full["lse"].transpose(1, 2)
    return full


def inputs(seqlen: int, heads: int, kv_heads: int, seed: int, dtype: torch.dtype = torch.float32, dim: int = 16):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, seqlen, h, dim) for h in (heads, kv_heads, kv_heads, heads)]
    return [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]


def check_cases(cases: list[tuple], seqlen: int) -> list[float]:
    """Worst relative error (out, lse, dq, dk, dv vs float64) of each ``(layout, causal, heads, kv_heads, spec)``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    worst = []
    for number, (layout, causal, heads, kv_heads, spec) in enumerate(cases):
        q, k, v, dout = inputs(seqlen, heads, kv_heads, seed=number)
        docs = documents(spec, 2, seqlen, world, seed=number)
        ref = masked_reference(q, k, v, dout, docs, causal, 0.25)
        got = run_documents(q, k, v, dout, docs, layout, causal)
        worst.append(max(rel_err(got[name], ref[name]) for name in ref))
    return worst


def check_algorithm_cases(state, algorithm: str, cases: list[tuple], seqlen: int) -> list[float]:
    """Worst relative error of each ``(layout, causal, heads, kv_heads, spec)`` with ``algorithm`` over this
    parallel state's CP groups (``spec`` None: no document mask; the balanced layout then gets one document)."""
    worst = []
    for number, (layout, causal, heads, kv_heads, spec) in enumerate(cases):
        q, k, v, dout = inputs(seqlen, heads, kv_heads, seed=number)
        docs = documents(spec or "one", 2, seqlen, state.cp.size, seed=number)
        masked = spec is not None or layout == "balanced"
        ref = masked_reference(q, k, v, dout, docs, causal, 0.25)
        got = run_documents(q, k, v, dout, docs, layout, causal, algorithm=algorithm, group=state.cp_groups,
                            masked=masked)
        worst.append(max(rel_err(got[name], ref[name]) for name in ref))
    return worst


def check_bf16(layout: str, seqlen: int) -> dict[str, tuple[float, float]]:
    """(ring bf16 error, the local kernel's bf16 error on the same mask) per tensor, both vs float64."""
    q, k, v, dout = inputs(seqlen, 4, 2, seed=11, dim=32)
    docs = documents("random", 2, seqlen, dist.get_world_size(), seed=11)
    ref = masked_reference(q, k, v, dout, docs, True, 32 ** -0.5)
    low = [x.bfloat16() for x in (q, k, v, dout)]
    plan = build_cp_plan(None, "contiguous", True, seqlen, docs, torch.arange(seqlen))
    local = [x.clone().requires_grad_(i < 3) for i, x in enumerate(low)]
    out = context_parallel_attention(*local[:3], None, "contiguous", True, plan=plan)
    out.backward(local[3])
    alone = {"out": out, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    ring = run_documents(*low, docs, layout, True, 32 ** -0.5)
    return {name: (rel_err(ring[name], ref[name]), rel_err(alone[name], ref[name])) for name in alone}


def count_work(layout: str, causal: bool, seqlen: int, spec: str, algorithm: str = "ring") -> dict[str, float]:
    """This rank's kernel calls, computed query-key pairs and bytes sent for one forward and backward."""
    q, k, v, dout = inputs(seqlen, 4, 2, seed=3, dim=8)
    docs = documents(spec, 2, seqlen, dist.get_world_size(), seed=3)
    ring_comm.BYTES_SENT.clear()
    area = [0]
    original = kernels.TorchCpuFlash.forward

    def counting_forward(self, q, k, v, causal, scale):  # noqa: ANN001
        rows, keys = q.shape[1], k.shape[1]
        area[0] += q.shape[0] * (rows * (rows + 1) // 2 if causal else rows * keys)
        return original(self, q, k, v, causal, scale)

    kernels.TorchCpuFlash.forward = counting_forward
    try:
        with counting_kernels() as counted:
            run_documents(q, k, v, dout, docs, layout, causal, head_chunks=2, algorithm=algorithm)
    finally:
        kernels.TorchCpuFlash.forward = original
    steps = []
    if algorithm == "ring":  # the dense calls of this rank's local step and of its remote steps
        positions = layout_positions(layout, docs, dist.get_rank(), dist.get_world_size())
        steps = build_cp_plan(dist.group.WORLD, layout, causal, seqlen // dist.get_world_size(),
                               _take(docs, positions), positions).ring.steps
    return {**counted, "area": area[0], "kv_bytes": ring_comm.BYTES_SENT[0], "grad_bytes": ring_comm.BYTES_SENT[1],
            "local_calls": len(steps[0].calls) if steps else 0,
            "remote_calls": sum(len(step.calls) for step in steps[1:]),
            "all_to_all": ring_comm.BYTES_SENT["all_to_all"], "all_gather": ring_comm.BYTES_SENT["all_gather"],
            "rank": dist.get_rank()}


def check_varlen(zigzag: bool, causal: bool, lengths: list[int]) -> dict[str, float]:
    """The ring-flash-attn varlen drop-ins on documents of global ``lengths``, against float64."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = sum(lengths)
    q, k, v, dout = (x[:1] for x in inputs(total, 4, 2, seed=sum(lengths)))
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    ref = masked_reference(q, k, v, dout, docs, causal, 0.25)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    pieces = 2 * world if zigzag else world
    mine = []  # this rank's global positions, in the package's local order
    for start, length in zip(starts[:-1], lengths, strict=True):
        chunk = length // pieces
        for piece in ((rank, 2 * world - 1 - rank) if zigzag else (rank,)):
            mine.append(torch.arange(start + piece * chunk, start + (piece + 1) * chunk))
    positions = torch.cat(mine)[None]
    local = [_take(x, positions)[0].requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    cu = torch.tensor(starts, dtype=torch.int32) // world
    function = zigzag_ring_flash_attn_varlen_func if zigzag else ring_flash_attn_varlen_func
    out, lse, none = function(*local[:3], cu, max(lengths) // world, softmax_scale=0.25, causal=causal,
                              return_attn_probs=True)
    assert none is None and lse.shape == (4, positions.shape[1])
    out.backward(local[3])
    got = {"out": out.detach(), "lse": lse.transpose(0, 1), "dq": local[0].grad, "dk": local[1].grad,
           "dv": local[2].grad}
    full = {name: gather_by_position(x[None], positions, total) for name, x in got.items()}
    full["lse"] = full["lse"].transpose(1, 2)
    return {name: rel_err(full[name], ref[name]) for name in ref}


def count_ulysses(layout: str, seqlen: int, spec: str) -> dict[str, object]:
    """Ulysses on documents: this rank's all-to-all bytes for one forward and backward, the plan's cross row
    counts, and the rows of this rank whose document also lies on another rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = inputs(seqlen, 4, 2, seed=3, dim=8)
    docs = documents(spec, 2, seqlen, world, seed=3)
    positions = [layout_positions(layout, docs, r, world) for r in range(world)]
    held = [torch.stack([docs[b, positions[r][b]] for b in range(2)]) for r in range(world)]
    plan = build_cp_plan(dist.group.WORLD, layout, True, seqlen // world, held[rank], positions[rank], "ulysses")
    ring_comm.BYTES_SENT.clear()
    run_documents(q, k, v, dout, docs, layout, True, head_chunks=1, algorithm="ulysses")
    spanning = sum(int(torch.isin(held[rank][b], torch.cat([held[o][b] for o in range(world) if o != rank])).sum())
                   for b in range(2))
    return {"all_to_all": ring_comm.BYTES_SENT["all_to_all"], "counts": plan.documents.counts,
            "samples": 1 if plan.packed else 2, "spanning": spanning, "home": plan.documents.home is not None}
