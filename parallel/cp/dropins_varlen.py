"""Drop-ins for the ring-flash-attn package's varlen functions: packed documents in the package's layouts.

q, k, v are ``[local_tokens, heads, head_dim]``: every document of the packed batch is split across the
CP ranks and each rank concatenates its pieces; ``cu_seqlens`` are the *local* offsets (global // cp, the
same on every rank) and ``max_seqlen`` the longest local document. Layouts:

- ``zigzag_ring_flash_attn_varlen_func``: each document is cut into ``2*cp`` chunks and rank r holds
  chunks r and ``2*cp-1-r`` (so every document's length is a multiple of ``2*cp``);
- ``ring_flash_attn_varlen_func``: each document is cut into ``cp`` contiguous pieces, rank r holds piece r.

Attention stays inside each document (causal or not). With ``return_attn_probs`` they return
``(out, lse, None)``, lse ``[heads, local_tokens]`` float32 (flash-attn's packed layout). The plan comes
from ``cu_seqlens`` alone, so no collective is needed to build it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.dropins import check_package_options, default_group
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents


def _local_pieces(cu_seqlens: torch.Tensor, world: int, zigzag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, positions within the document) ``[world, 1, local_tokens]`` of every rank's tokens."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    docs, positions = [], []
    for rank in range(world):
        rank_docs, rank_positions = [], []
        for doc, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            local = stop - start
            if zigzag:
                if local % 2:
                    raise ValueError(f"document {doc} has {local} local tokens ({local * world} in all): zigzag "
                                     f"needs every document's length to be a multiple of 2*cp = {2 * world}")
                chunk = local // 2
                mine = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                                  torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)])
            else:
                mine = torch.arange(rank * local, (rank + 1) * local)
            rank_docs.append(torch.full((local,), doc))
            rank_positions.append(mine)
        docs.append(torch.cat(rank_docs))
        positions.append(torch.cat(rank_positions))
    return torch.stack(docs)[:, None], torch.stack(positions)[:, None]


def _varlen(zigzag: bool, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
            alibi_slopes, deterministic, return_attn_probs, group):
    window = check_package_options(dropout_p, window_size, alibi_slopes, causal)
    if q.dim() != 3:
        raise ValueError(f"q must be [local_tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens must be the local offsets [0, ..., {q.shape[0]}], got {cu_seqlens.tolist()}")
    group = default_group(group)
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    docs, positions = _local_pieces(cu_seqlens.cpu(), world, zigzag)
    ring = plan_for_documents(docs, positions, rank, causal, window)
    plan = CPPlan(get_cp_algorithm("ring"), ring, None, ring.packed, ring.areas, ring.max_calls, window=window)
    out, lse = context_parallel_attention(q[None], k[None], v[None], group, "zigzag" if zigzag else "contiguous",
                                          causal, softmax_scale, return_lse=True,
                                          deterministic=deterministic or None, plan=plan)
    return (out[0], lse[0], None) if return_attn_probs else out[0]


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None):
    """Packed documents, each zigzag-split over the CP ranks (see the module docstring)."""
    return _varlen(True, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, deterministic, return_attn_probs, group)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None):
    """Packed documents, each split into contiguous pieces over the CP ranks (see the module docstring)."""
    return _varlen(False, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, deterministic, return_attn_probs, group)


__all__ = ["zigzag_ring_flash_attn_varlen_func", "ring_flash_attn_varlen_func"]
