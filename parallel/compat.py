"""torch.distributed names that changed between the supported torch releases (chosen once, at import).

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (same arguments) and warns on the old names; torch 2.9 has only the old ones.
The calls look the function up on ``torch.distributed`` each time, so wrappers installed there (the
trainer's collective tracing) still see them.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
    return getattr(dist, _REDUCE_SCATTER)(output, input, group=group, async_op=async_op)
