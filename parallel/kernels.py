"""Flash-attention kernels behind one interface, returning the log-sum-exp.

Contract (every backend):

- ``flash_forward(q, k, v, causal, softmax_scale) -> (out, lse)``
- ``flash_backward(dout, q, k, v, out, lse, causal, softmax_scale) -> (dq, dk, dv)``

Layout ``[batch, seqlen, heads, head_dim]`` (flash-attn's). k and v may have
fewer heads than q (GQA: ``heads % kv_heads == 0``); they are expanded inside
the kernel call only. ``lse`` is ``[batch, heads, seqlen_q]`` in float32
(float64 for the math backend), natural log, scale included. ``causal`` is
only used on square (seqlen_q == seqlen_k) blocks by the ring, where every
backend agrees. The backward, given the *final* merged ``out``/``lse`` of the
query rows, returns this K/V block's exact share of dq and its exact dk/dv.

Backends: ``flash_attn`` (the package, CUDA only), ``torch`` (PyTorch's own
flash ops, CPU and CUDA) and ``math`` (float64 reference, for tests).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections import Counter

import torch

BACKENDS: tuple[str, ...] = ("flash_attn", "torch", "math")
KERNEL_CALLS: Counter[str] = Counter()  # "forward"/"backward" calls in this process (tests count them)

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def select_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend to use on ``device``: ``backend`` if given, else flash_attn on CUDA when installed, else torch."""
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend == "flash_attn" and not (_HAS_FLASH_ATTN and device.type == "cuda"):
            raise ValueError("backend 'flash_attn' needs the flash-attn package and CUDA tensors; "
                             "use backend='torch' or install cp-train[gpu]")
        return backend
    return "flash_attn" if (_HAS_FLASH_ATTN and device.type == "cuda") else "torch"


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, Hk, D] -> [B, S, heads, D]; a stride-0 view when Hk == 1, else a copy."""
    kv_heads = x.shape[2]
    if kv_heads == heads:
        return x
    if kv_heads == 1:
        return x.expand(-1, -1, heads, -1)
    b, s, _, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv_heads, heads // kv_heads, d).reshape(b, s, heads, d)


def _reduce_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the expanded heads' gradients back onto the kv heads: [B, S, H, D] -> [B, S, Hk, D]."""
    b, s, heads, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.reshape(b, s, kv_heads, heads // kv_heads, d).sum(dim=3)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  softmax_scale: float | None = None, backend: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Sq, H, D] on k, v [B, Sk, Hk, D]: out [B, Sq, H, D] (q's dtype), lse [B, H, Sq]."""
    KERNEL_CALLS["forward"] += 1
    scale = _scale(q, softmax_scale)
    backend = select_backend(q.device, backend)
    if backend == "math":
        return _math_forward(q, k, v, causal, scale)
    if backend == "flash_attn":
        return _flash_attn_forward(q, k, v, causal, scale)
    heads = q.shape[2]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale)[:2]
    return out.transpose(1, 2), lse


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                   softmax_scale: float | None = None, backend: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [B, Sq, H, D], dk, dv [B, Sk, Hk, D]) of one K/V block, given the rows' final out/lse."""
    KERNEL_CALLS["backward"] += 1
    scale = _scale(q, softmax_scale)
    backend = select_backend(q.device, backend)
    if backend == "math":
        return _math_backward(dout, q, k, v, causal, scale)
    if backend == "flash_attn":
        return _flash_attn_backward(dout, q, k, v, out, lse, causal, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
    args = (dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
            out.transpose(1, 2), lse)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *args, 0.0, causal, scale=scale)
    else:
        no_rng = torch.empty((), dtype=torch.long, device=q.device)  # dropout is 0: no RNG state is read
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *args[:5], lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal, no_rng, no_rng, scale=scale)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, _reduce_kv_grad(dk, kv_heads), _reduce_kv_grad(dv, kv_heads)


def _flash_attn_new_api(fn) -> bool:
    """flash-attn >= 2.6 takes window_size_left/right and softcap; 2.5 took one window_size tuple."""
    return "window_size_left" in inspect.signature(fn).parameters


def _flash_attn_forward(q, k, v, causal, scale):  # pragma: no cover - needs CUDA + flash-attn
    from flash_attn.flash_attn_interface import _flash_attn_forward as fwd

    if _flash_attn_new_api(fwd):  # -> out, lse, S_dmask, rng_state
        out, lse = fwd(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)[:2]
    else:  # -> out, q, k, v, out_padded, lse, S_dmask, rng_state
        result = fwd(q, k, v, 0.0, scale, causal, (-1, -1), None, False)
        out, lse = result[0], result[5]
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):  # pragma: no cover - needs CUDA
    from flash_attn.flash_attn_interface import _flash_attn_backward as bwd

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dout, lse = dout.contiguous(), lse.contiguous()  # the CUDA kernels want dense [B, H, S] lse
    if _flash_attn_new_api(bwd):
        bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False)
    else:
        bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, (-1, -1), None, False)
    return dq, dk, dv


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """float64 scores [B, H, Sq, Sk] with the causal mask aligned top-left (query i sees keys j <= i)."""
    heads = q.shape[2]
    k = _expand_kv(k, heads).double()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _math_forward(q, k, v, causal, scale):
    scores = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, _expand_kv(v, q.shape[2]).double())
    return out, lse.masked_fill(torch.isinf(lse), 0.0)


def _math_backward(dout, q, k, v, causal, scale):
    with torch.enable_grad():
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out, _ = _math_forward(q64, k64, v64, causal, scale)
        return torch.autograd.grad(out, (q64, k64, v64), dout.double())
