"""torch.distributed names that changed between the supported torch releases (chosen once, at import).

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (same arguments) and warns on the old names; torch 2.9-2.11 have only the old ones
(FSDP2 calls those there); ``ALL_GATHER_NAME`` / ``REDUCE_SCATTER_NAME`` are the ones this torch has.
The calls look the function up on ``torch.distributed`` each time, so wrappers installed there (the
trainer's collective tracing) still see them. The functional collectives were renamed the same way
(``all_gather_tensor`` / ``reduce_scatter_tensor`` -> ``*_single``): ``functional_all_gather`` and
``functional_reduce_scatter`` are whichever this torch has.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
COLLECTIVE_HELPERS = ("all_gather_single", "reduce_scatter_single")  # the collective trace names their callers


def all_gather_single(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
    return getattr(dist, ALL_GATHER_NAME)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: Any, input: Any, group: Any = None, async_op: bool = False,  # noqa: A002
                          op: Any = dist.ReduceOp.SUM) -> Any:
    return getattr(dist, REDUCE_SCATTER_NAME)(output, input, op=op, group=group, async_op=async_op)


functional_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
functional_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
