"""Drop-ins for the ring-flash-attn package's functions (same argument names and order).

Each takes this rank's slice ``[batch, local_seqlen, heads, head_dim]`` in the layout its name says
and returns this rank's output slice; ``group`` is the CP process group (None: the default group).
With ``return_attn_probs=True`` they return ``(out, lse, None)``, lse ``[batch, heads, local_seqlen]``
fp32. ``window_size=(left, right)`` is flash-attn's sliding window (-1: unbounded; ``right`` > 0 only without
causal): converted once here (``window_plan.as_window``; HF's W is ``left + 1``). The varlen forms are in
``dropins_varlen.py``.
"""

from __future__ import annotations

import torch.distributed as dist

from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.plan.window_plan import Window, as_window


def check_package_options(dropout_p: float, window_size: tuple[int, int], alibi_slopes: object,
                          causal: bool = True) -> Window | None:
    """The ring-flash-attn arguments this ring does not implement must keep their defaults; returns the
    ``Window`` of ``window_size`` (None: unbounded)."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p} is not supported yet; pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported yet; pass alibi_slopes=None")
    return as_window(tuple(window_size), causal)


def default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """These functions' None is the default group (or no group without torch.distributed)."""
    return dist.group.WORLD if group is None and dist.is_initialized() else group


def _package_api(layout: str, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                 deterministic, return_attn_probs, group):
    window = check_package_options(dropout_p, window_size, alibi_slopes, causal)
    # the ring adds its blocks in a fixed order; ``deterministic`` reaches the kernels' backward
    out, lse = context_parallel_attention(q, k, v, default_group(group), layout, causal, softmax_scale,
                                          return_lse=True, deterministic=deterministic or None, window=window)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """Ring attention on the contiguous layout (rank r holds the r-th block of the sequence)."""
    return _package_api("contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                        deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """Ring attention on the zigzag layout (rank r holds chunks r and 2*cp-1-r of 2*cp)."""
    return _package_api("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                        deterministic, return_attn_probs, group)


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """Ring attention on the stripe layout (token t on rank t % cp)."""
    return _package_api("stripe", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                        deterministic, return_attn_probs, group)


__all__ = ["ring_flash_attn_func", "zigzag_ring_flash_attn_func", "stripe_flash_attn_func"]
