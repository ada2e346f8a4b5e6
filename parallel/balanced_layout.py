"""The ``balanced`` CP layout: each sample's chunks dealt to the ranks by their attention work.

Zigzag balances the causal work of one document per sample, not of many packed documents: a token's
work is the number of keys it sees, its position in its *document* plus one, so a rank holding the
starts of documents does less. ``balanced`` cuts each sample into ``chunks_per_rank * world`` equal
chunks, weighs each chunk by its tokens' work and deals the chunks to the ranks, ``chunks_per_rank``
each, heaviest first to the least loaded rank, then swaps pairs while that lowers the heaviest
rank's load (an LPT schedule with a local search). Every rank computes the same assignment from the
sample's document ids, so the loader and any rank can rebuild it; each rank keeps its chunks in
sequence order, and positions, labels, loss mask and document ids follow the tokens.
"""

from __future__ import annotations

import torch

CHUNKS_PER_RANK = 8


def token_work(document_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Keys each token sees under the per-document mask: ``[..., S]`` int64 (its position in its document
    plus one, or its document's length when not causal). ``document_ids`` non-decreasing along S."""
    ids = document_ids.to(torch.int64)
    seq = ids.shape[-1]
    flat = ids.reshape(-1, seq)
    work = torch.empty_like(flat)
    index = torch.arange(seq)
    for row, docs in enumerate(flat):
        starts = torch.ones(seq, dtype=torch.bool)
        starts[1:] = docs[1:] != docs[:-1]
        first = torch.cummax(torch.where(starts, index, 0), dim=0).values  # each token's document start
        if causal:
            work[row] = index - first + 1
        else:
            lengths = torch.bincount(torch.cumsum(starts.long(), 0) - 1)
            work[row] = lengths[torch.cumsum(starts.long(), 0) - 1]
    return work.reshape(ids.shape)


def balanced_positions(document_ids: torch.Tensor, world: int, chunks_per_rank: int = CHUNKS_PER_RANK,
                       causal: bool = True) -> torch.Tensor:
    """Every rank's token positions ``[world, S // world]`` (sorted) for one sample's ``document_ids [S]``."""
    seq = document_ids.shape[-1]
    count = world * chunks_per_rank
    if seq % count:
        raise ValueError(f"the balanced layout cuts a sample into {chunks_per_rank} chunks per rank: sequence "
                         f"length {seq} is not divisible by {chunks_per_rank}*cp = {count}")
    size = seq // count
    weights = token_work(document_ids, causal).reshape(count, size).sum(1).tolist()
    owner = _deal(weights, world, chunks_per_rank)
    chunks = [sorted(c for c in range(count) if owner[c] == r) for r in range(world)]
    base = torch.arange(size)
    return torch.stack([torch.cat([base + c * size for c in mine]) for mine in chunks])


def _deal(weights: list[int], world: int, per_rank: int) -> list[int]:
    """Chunk -> rank, ``per_rank`` chunks each, balancing the summed weights (deterministic)."""
    load, held = [0] * world, [0] * world
    owner = [0] * len(weights)
    for chunk in sorted(range(len(weights)), key=lambda c: (-weights[c], c)):
        rank = min((r for r in range(world) if held[r] < per_rank), key=lambda r: (load[r], r))
        owner[chunk], load[rank], held[rank] = rank, load[rank] + weights[chunk], held[rank] + 1
    for _ in range(4 * len(weights)):  # swap a chunk of the heaviest rank with a lighter one's while it helps
        heavy = max(range(world), key=lambda r: (load[r], -r))
        best = None
        for a in (c for c in range(len(weights)) if owner[c] == heavy):
            for b in (c for c in range(len(weights)) if owner[c] != heavy and weights[c] < weights[a]):
                other = owner[b]
                delta = weights[a] - weights[b]
                peak = max(load[heavy] - delta, load[other] + delta)
                if peak < load[heavy] and (best is None or peak < best[0]):
                    best = (peak, a, b)
        if best is None:
            break
        _, a, b = best
        other, delta = owner[b], weights[a] - weights[b]
        owner[a], owner[b] = other, heavy
        load[heavy], load[other] = load[heavy] - delta, load[other] + delta
    return owner
