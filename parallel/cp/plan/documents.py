"""Every CP rank's document ids and positions, gathered for the per-document CP plan."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.compat import all_gather_single
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, sequence_positions


def _is_int(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def gather_mask_inputs(document_ids: torch.Tensor, position_ids: torch.Tensor | None,
                       group: dist.ProcessGroup | None, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, positions), each ``[world, B, n]`` int64 on the CPU, every rank's in rank order.

    ``document_ids`` [B, n] and ``position_ids`` [B, n] or [n] (None: the positions of ``layout``) are this
    rank's. One all-gather over ``group`` (on the tensors' device); none without a group.
    """
    if document_ids.dim() != 2 or not _is_int(document_ids):
        raise ValueError(f"document_ids must be an integer tensor [batch, local_seqlen], got {document_ids.dtype} "
                         f"{tuple(document_ids.shape)}")
    batch, n = document_ids.shape
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    if position_ids is None:
        if layout not in STATIC_LAYOUTS:
            raise ValueError(f"the {layout!r} CP layout places tokens per sample: pass position_ids")
        position_ids = sequence_positions(n * world, rank, world, layout, device=document_ids.device)
    if not _is_int(position_ids) or tuple(position_ids.shape) not in ((batch, n), (n,)):
        raise ValueError(f"position_ids must be integer [batch, local_seqlen] = [{batch}, {n}] (or [{n}]), got "
                         f"{position_ids.dtype} {tuple(position_ids.shape)}")
    mine = torch.stack([document_ids.to(torch.int64), position_ids.to(torch.int64).expand(batch, n)])
    if world == 1:
        every = mine.unsqueeze(0)
    else:
        every = torch.empty((world * 2, batch, n), dtype=torch.int64, device=mine.device)
        all_gather_single(every, mine.contiguous(), group=group)
        every = every.view(world, 2, batch, n)
    every = every.cpu()
    return every[:, 0], every[:, 1]
