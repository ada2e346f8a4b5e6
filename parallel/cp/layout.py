"""How a sequence is split across the context-parallel (CP) ranks.

Layouts (``world`` = CP size, ``S`` = global sequence length):

- ``contiguous``: rank r holds tokens ``[r*S/world, (r+1)*S/world)``.
- ``zigzag``: the sequence is cut into ``2*world`` equal chunks; rank r holds
  chunks r and ``2*world-1-r`` (in that order), which balances causal work.
- ``stripe``: token t lives on rank ``t % world`` (local order = global order).
- ``balanced``: each sample's tokens are dealt to the ranks by their attention work under the
  per-document mask, by recursive circular bisection (``balanced_layout.py``; one document
  gives zigzag); which positions a rank holds depends on the sample, so the loader passes them on as
  ``position_ids`` (no static positions).

Every function takes the sequence dimension as ``dim`` (default 1, i.e.
``[batch, seqlen, ...]`` tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.layout_names import (  # noqa: F401 - re-exported: the layouts' names
    LAYOUTS,
    STATIC_LAYOUTS,
    Layout,
    check_layout,
    check_layout_name,
)


def sequence_positions(seqlen: int, rank: int, world: int, layout: str,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Global token positions (int64, shape ``[seqlen // world]``) held by ``rank``, in local order."""
    check_layout(seqlen, world, layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the CP group of size {world}")
    if layout not in STATIC_LAYOUTS:
        raise ValueError(f"the {layout!r} layout places tokens per sample: use "
                         f"parallel.balanced_layout.balanced_positions(document_ids, world)")
    local = seqlen // world
    if layout == "contiguous":
        return torch.arange(rank * local, (rank + 1) * local, device=device)
    if layout == "stripe":
        return torch.arange(rank, seqlen, world, device=device)
    chunk = seqlen // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk, device=device)
    return torch.cat([first, last])


def shard_sequence(x: torch.Tensor, rank: int, world: int, layout: str, dim: int = 1) -> torch.Tensor:
    """The slice of the full-sequence tensor ``x`` that ``rank`` holds (a new tensor)."""
    positions = sequence_positions(x.shape[dim], rank, world, layout, device=x.device)
    if layout == "contiguous":
        return x.narrow(dim, int(positions[0]), positions.numel()).clone()
    return x.index_select(dim, positions)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], layout: str,
                     dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: ``shards[r]`` is rank r's slice; returns the full tensor."""
    world = len(shards)
    stacked = torch.cat(list(shards), dim=dim)
    if layout == "contiguous":
        check_layout(stacked.shape[dim], world, layout)
        return stacked
    seqlen = stacked.shape[dim]
    order = torch.cat([sequence_positions(seqlen, r, world, layout) for r in range(world)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seqlen)
    return stacked.index_select(dim, inverse.to(stacked.device))


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, layout: str,
                    dim: int = 1) -> torch.Tensor:
    """All-gather every CP rank's slice ``x`` over ``group`` and return the full sequence.

    Not differentiable; meant for evaluation, logging and tests.
    """
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, layout, dim=dim)
