"""The ``balanced`` CP layout: each sample's tokens dealt to the ranks by their attention work.

Zigzag balances the causal work of one document per sample, not of many packed documents: a token's
work is the number of keys it sees (its position in its document plus one; its document's length when
not causal), so a rank holding the starts of documents does less. ``balanced`` splits each sample by
*recursive circular bisection*:

- the ranks are halved, and the sample's tokens, read as a circle in sequence order, are cut at two
  points into an arc for the first half and the rest for the second; the arc holds exactly its half's
  share of the tokens and, as nearly as possible, its share of the work;
- each half's tokens (again a circle, in sequence order) are cut the same way, down to single ranks.

An arc of a fixed length slid around the circle holds the share of the work on average, so some arc is
within one token's work of it: the imbalance is essentially 1. Among near-equal cuts the one that splits
the fewest earlier rows of a document (K/V rows the other side must receive) wins, so many short
documents are mostly cut at their starts, and each rank holds a few runs of the sample (at most two
cuts per bisection). One document per sample gives the zigzag layout at power-of-two cp.

Every rank computes the same assignment from the sample's document ids (integer arithmetic, no ties
left open), so the loader and any rank can rebuild it; each rank keeps its tokens in sequence order, and
positions, labels, loss mask and document ids follow the tokens. The only divisibility it needs is
``S % cp == 0``.
"""

from __future__ import annotations

import torch

from cp_train.parallel.cp.layout import check_layout

ROW_WORK = 4  # a document row cut off from its later rows is priced as this many query-key pairs of work


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``[S]`` int64: the position where each token's document starts (``document_ids [S]`` non-decreasing)."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq)
    starts = torch.ones(seq, dtype=torch.bool)
    starts[1:] = document_ids[1:] != document_ids[:-1]
    return torch.cummax(torch.where(starts, index, 0), dim=0).values


def _work_from_starts(starts: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[S]`` keys each token sees, from its document's start position ``starts [S]``."""
    if causal:
        return torch.arange(starts.numel()) - starts + 1
    return torch.bincount(starts)[starts]  # the count of tokens sharing a start: the document's length


def token_work(document_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Keys each token sees under the per-document mask: ``[..., S]`` int64 (its position in its document
    plus one, or its document's length when not causal). ``document_ids`` non-decreasing along S."""
    ids = document_ids.to(torch.int64)
    flat = ids.reshape(-1, ids.shape[-1])
    return torch.stack([_work_from_starts(document_starts(docs), causal) for docs in flat]).reshape(ids.shape)


def _arc(positions: torch.Tensor, work: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor,
         part: int, parts: int) -> torch.Tensor:
    """``[n]`` bool: the arc of the circular token list (``positions``, ``work``, document ``starts`` and
    ``ids`` of n tokens in sequence order) holding ``part / parts`` of its tokens, chosen for the least
    ``|arc work - part/parts of the work| + ROW_WORK * rows cut``, the first such arc on ties."""
    n = positions.numel()
    length = n * part // parts
    prefix = torch.cat([work.new_zeros(1), torch.cumsum(torch.cat([work, work]), 0)])
    begin = torch.arange(n)
    arc_work = prefix[begin + length] - prefix[begin]
    # a cut before token i splits off the rows of i's document before it (none at a document start)
    cut_rows = torch.where(ids == ids.roll(1), positions - starts, 0)
    rows = cut_rows + cut_rows[(begin + length) % n]
    score = (arc_work * parts - prefix[n] * part).abs() + ROW_WORK * parts * rows  # exact integers
    first = int(torch.argmin(score))
    inside = torch.zeros(n, dtype=torch.bool)
    inside[(first + torch.arange(length)) % n] = True
    return inside


def balanced_positions(document_ids: torch.Tensor, world: int, causal: bool = True) -> torch.Tensor:
    """Every rank's token positions ``[world, S // world]`` (sorted) for one sample's ``document_ids [S]``."""
    seq = document_ids.shape[-1]
    check_layout(seq, world, "balanced")
    ids = document_ids.to(torch.int64).reshape(seq)
    starts = document_starts(ids)
    work = _work_from_starts(starts, causal)
    owner = torch.empty(seq, dtype=torch.int64)
    pending = [(torch.arange(seq), 0, world)]  # (tokens, first rank, ranks) still to split
    while pending:
        tokens, first_rank, ranks = pending.pop()
        if ranks == 1:
            owner[tokens] = first_rank
            continue
        half = ranks // 2
        inside = _arc(tokens, work[tokens], starts[tokens], ids[tokens], half, ranks)
        pending += [(tokens[inside], first_rank, half), (tokens[~inside], first_rank + half, ranks - half)]
    return torch.stack([torch.nonzero(owner == rank).flatten() for rank in range(world)])
