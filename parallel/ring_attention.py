"""Ring flash attention over a context-parallel group: public API.

All functions take this rank's slice of the sequence, laid out
``[batch, local_seqlen, heads, head_dim]`` in the CP layout named by the
function (see ``parallel/layout.py``), and return this rank's output slice.
The ``*_func`` functions keep the argument names and order of the
ring-flash-attn package so they are drop-in replacements; ``group`` is the CP
process group (None: the default group). With ``return_attn_probs=True`` they
return ``(out, lse, None)`` with lse ``[batch, heads, local_seqlen]`` fp32.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.attention_plan import RankPlan, plan_for_documents, plan_for_layout
from parallel.document_mask import gather_mask_inputs
from parallel.kernels import BACKENDS, KERNEL_CALLS, select_kernel
from parallel.layout import LAYOUTS, STATIC_LAYOUTS
from parallel.ring_comm import RingComm
from parallel.ring_core import RingSpec, ring_backward, ring_forward

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def default_head_chunks(device: torch.device, kv_heads: int, plan: RankPlan | None = None) -> int:
    """Two on GPUs, so that the backward's last dK/dV hop of one chunk travels during the next chunk's
    compute. On CPU one kv head per chunk when each ring step is one or two big kernel calls (it bounds
    the ring's buffers at no speed cost), one chunk when packed documents make many small calls (small
    calls run slower, and their buffers are small anyway)."""
    if device.type != "cpu":
        return min(2, kv_heads)
    return kv_heads if plan is None or plan.max_calls <= 2 else 1


def default_overlap(device: torch.device) -> bool:
    """The backward's overlap policy (see ``ring_core``): on for GPUs, off on CPU (memory first)."""
    return device.type != "cpu"


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, world: int) -> None:
    """Raise ``ValueError`` saying what to change when q/k/v cannot go through the ring."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [batch, seqlen, heads, head_dim], got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; attention needs a floating dtype "
                             "(float16, bfloat16, float32 or float64)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local seqlen "
                         "and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    n = q.shape[1]
    if n == 0:
        raise ValueError("the local sequence is empty")
    if layout == "zigzag" and n % 2 != 0:
        raise ValueError(f"zigzag needs an even local sequence length, got {n}: make the global sequence "
                         f"length ({n * world}) a multiple of 2*cp = {2 * world}")


class _RingAttention(torch.autograd.Function):
    """Ring attention with autograd; ``plan`` None (cp = 1, one document) is one kernel call each way."""

    @staticmethod
    def forward(ctx, q, k, v, group, spec: RingSpec, plan: RankPlan | None):
        comm = RingComm(group) if group is not None and dist.get_world_size(group) > 1 else None
        if plan is None:
            KERNEL_CALLS["forward"] += 1
            out, lse = spec.kernel.forward(q, k, v, spec.causal, spec.scale)  # lse [B, H, n]
        else:
            out, lse = ring_forward(q, k, v, comm, spec, plan)
            lse = lse.transpose(1, 2)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.spec, ctx.plan = comm, spec, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        spec = ctx.spec
        if ctx.plan is None:
            KERNEL_CALLS["backward"] += 1
            dq, dk, dv = spec.kernel.backward(dout, q, k, v, out, lse, spec.causal, spec.scale)
        else:
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse.transpose(1, 2), ctx.comm, spec, ctx.plan)
        if dq.dtype != q.dtype:
            dq, dk, dv = dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
        return dq, dk, dv, None, None, None


def attention_plan(group: dist.ProcessGroup | None, layout: str, causal: bool, local_len: int,
                   document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                   ) -> RankPlan | None:
    """This rank's ring plan (None: cp = 1 and one document per sample, the plain local kernel).

    With ``document_ids`` ([B, n], this rank's tokens' documents in the CP layout) the plan follows the
    per-document mask; it gathers every rank's documents and positions over ``group`` (``position_ids``
    [B, n] or [n], the tokens' positions; default: the layout's). Build it once per batch and pass it to
    every layer (``context_parallel_attention(..., plan=...)``).
    """
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    if document_ids is None and layout not in STATIC_LAYOUTS and world > 1:
        raise ValueError(f"the {layout!r} layout places tokens by their documents: pass document_ids and "
                         f"position_ids")
    if document_ids is None:
        return plan_for_layout(layout, causal, world, rank, local_len) if world > 1 else None
    docs, positions = gather_mask_inputs(document_ids, position_ids, group, layout)
    return plan_for_documents(docs, positions, rank, causal)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | None, layout: str = "zigzag", causal: bool = True,
                               softmax_scale: float | None = None, backend: str | None = None,
                               head_chunks: int | None = None, return_lse: bool = False,
                               deterministic: bool | None = None, overlap: bool | None = None,
                               document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                               plan: RankPlan | None = None):
    """Exact attention of this rank's q on the whole sequence's k/v, over the CP ``group``.

    q [B, n, H, D]; k, v [B, n, Hk, D] (GQA when Hk < H), all in ``layout``. ``group`` None
    (or a group of one) means no context parallelism: the local kernel on this sequence.
    Returns out [B, n, H, D] in q's dtype (and lse [B, H, n] fp32 if ``return_lse``).
    ``backend`` picks the kernel (see parallel/kernels.py; None: the best for the device and
    dtype); ``deterministic`` (None: ``torch.are_deterministic_algorithms_enabled()``) asks the
    kernels for a deterministic backward; ``head_chunks`` bounds the ring's transient memory and
    ``overlap`` is the backward's overlap policy (defaults: ``default_head_chunks``, ``default_overlap``).
    ``document_ids`` [B, n] (this rank's tokens' documents, non-decreasing along each sample) restrict
    attention to each token's own document; ``position_ids`` order tokens within a document (default:
    the layout's positions; required for the ``balanced`` layout). ``plan`` (from ``attention_plan``,
    for the same documents) saves rebuilding it in every layer.
    """
    world = dist.get_world_size(group) if group is not None else 1
    check_inputs(q, k, v, layout, world)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if plan is None:
        plan = attention_plan(group, layout, causal, q.shape[1], document_ids, position_ids)
    spec = RingSpec(
        layout=layout, causal=causal,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        kernel=select_kernel(q.device, q.dtype, q.shape[-1], backend, deterministic),
        head_chunks=head_chunks if head_chunks is not None else default_head_chunks(q.device, k.shape[2], plan),
        overlap=default_overlap(q.device) if overlap is None else overlap, varlen=q.device.type == "cuda")
    out, lse = _RingAttention.apply(q, k, v, group, spec, plan)
    return (out, lse) if return_lse else out


def check_package_options(dropout_p: float, window_size: tuple[int, int], alibi_slopes: object) -> None:
    """The ring-flash-attn arguments this ring does not implement must keep their defaults."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p} is not supported yet; pass dropout_p=0.0")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)} (sliding window) is not supported yet; "
                                  "pass window_size=(-1, -1)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported yet; pass alibi_slopes=None")


def _package_api(layout: str, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                 deterministic, return_attn_probs, group):
    check_package_options(dropout_p, window_size, alibi_slopes)
    if group is None and dist.is_initialized():  # these functions' None is the default group
        group = dist.group.WORLD
    # the ring adds its blocks in a fixed order; ``deterministic`` reaches the kernels' backward
    out, lse = context_parallel_attention(q, k, v, group, layout, causal, softmax_scale, return_lse=True,
                                          deterministic=deterministic or None)
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


__all__ = ["context_parallel_attention", "ring_flash_attn_func", "zigzag_ring_flash_attn_func",
           "stripe_flash_attn_func"]
