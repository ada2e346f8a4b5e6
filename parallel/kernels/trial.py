"""The trial call that admits a CUDA attention backend (``select.py``): a tiny forward and backward on the device.

Importing a package proves nothing about the running GPU (a flash-attn wheel without kernels for it, a
cuDNN build that refuses a shape): ``trial_call`` runs the kernel once, dense causal and varlen, with GQA,
and raises whatever the kernel raises.
"""

from __future__ import annotations

import contextlib

import torch

from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows, VarlenSegments


def _real_tensors() -> contextlib.AbstractContextManager[object]:
    """Real tensors for the trial even when a selection happens under a fake-tensor mode (tracing)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - private API, present in every supported torch
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def trial_call(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """A tiny forward and backward of ``kernel`` on ``device`` (dense causal and varlen, GQA); raises what the
    kernel raises, or RuntimeError for a non-finite result. Synchronises, so late CUDA errors surface here."""
    with _real_tensors():
        _calls(kernel, device, dtype, head_dim)


def _calls(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, 16, 2, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 16, 1, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
    out, lse = kernel.forward(q, k, v, True, head_dim ** -0.5)
    grads = kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, head_dim ** -0.5)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device=device)
    segments = VarlenSegments(cu, cu, 8, 8)
    var_out, var_lse = kernel.varlen_forward(q[0], k[0], v[0], segments, True, head_dim ** -0.5)
    var_grads = kernel.varlen_backward(BackwardRows(dout[0], q[0], var_out, var_lse), k[0], v[0], segments, True,
                                       head_dim ** -0.5)
    if not all(bool(torch.isfinite(t).all()) for t in (out, lse, *grads, var_out, var_lse, *var_grads)):
        raise RuntimeError("the trial call returned non-finite values")


def native_gqa_agrees(kernel: AttentionKernel, native: AttentionKernel, device: torch.device, dtype: torch.dtype,
                      head_dim: int) -> bool:
    """Whether ``native`` (``kernel`` handing fewer K/V heads to its op as they are) gives ``kernel``'s results on
    ``device``: a tiny causal GQA forward and backward, within the dtype's rounding. False when it raises."""
    with _real_tensors():
        gen = torch.Generator(device=device).manual_seed(1)
        q, dout = (torch.randn(1, 32, 4, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
        k, v = (torch.randn(1, 32, 2, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
        scale = head_dim ** -0.5
        try:
            got = _forward_backward(native, q, k, v, dout, scale)
        except Exception:  # noqa: BLE001 - a build that refuses GQA refuses it in its own way
            return False
        want = _forward_backward(kernel, q, k, v, dout, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return all(a.shape == b.shape and float((a.float() - b.float()).norm()) <= tolerance * float(b.float().norm())
               for a, b in zip(got, want, strict=True))


def _forward_backward(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    out, lse = kernel.forward(q, k, v, True, scale)
    return (out, lse, *kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, scale))
