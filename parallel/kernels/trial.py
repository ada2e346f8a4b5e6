"""The trial call that admits a CUDA attention backend (``select.py``): a tiny forward and backward on the device,
checked against the float64 reference.

Importing a package proves nothing about the running GPU (a flash-attn wheel without kernels for it, a
cuDNN build that refuses a shape or mixes up a layout): ``trial_call`` runs the kernel once, dense causal and
varlen (causal, one segment with more keys than rows), with GQA (4 query heads on 2 K/V heads: the expanding
copy, as models run it), raises whatever the kernel raises, and raises RuntimeError where a result is not finite
or is off ``MathKernel``'s on the same inputs by more than the dtype's tolerance (``TOLERANCE``).
"""

from __future__ import annotations

import contextlib

import torch

from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows, VarlenSegments
from cp_train.parallel.kernels.reference import MathKernel

TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}  # relative (norm) error, by dtype
NAMES = ("out", "lse", "dq", "dk", "dv")


def _real_tensors() -> contextlib.AbstractContextManager[object]:
    """Real tensors for the trial even when a selection happens under a fake-tensor mode (tracing)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - private API, present in every supported torch
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def tolerance(dtype: torch.dtype) -> float:
    """The trial's relative tolerance for ``dtype`` (fp32: well above its rounding, far below any mix-up)."""
    return TOLERANCE.get(dtype, 1e-10)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (inf for a shape mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def trial_call(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """A tiny forward and backward of ``kernel`` on ``device`` (dense causal and varlen, GQA); raises what the
    kernel raises, or RuntimeError naming the call and the result that is non-finite or off the float64
    reference. Synchronises, so late CUDA errors surface here."""
    with _real_tensors():
        _calls(kernel, device, dtype, head_dim)


def _calls(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, 16, 4, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 16, 2, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
    exact = [x.double() for x in (q, k, v, dout)]  # the same values for the reference, which keeps float64
    scale, reference = head_dim ** -0.5, MathKernel()
    dense = _forward_backward(kernel, q, k, v, dout, scale)
    _check("dense", dense, _forward_backward(reference, *exact, scale), tolerance(dtype))
    # a segment of 6 rows on 8 keys (causal from the bottom right, as the ring's varlen steps) and one of 8 on 8
    segments = VarlenSegments(*(torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, 6, 14], [0, 8, 16])),
                              8, 8)
    varlen = _varlen(kernel, q[0, :14], k[0], v[0], dout[0, :14], segments, scale)
    q64, k64, v64, dout64 = exact
    _check("varlen", varlen, _varlen(reference, q64[0, :14], k64[0], v64[0], dout64[0, :14], segments, scale),
           tolerance(dtype))


def _check(call: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float) -> None:
    """RuntimeError unless every result of ``got`` is finite and within ``tol`` of ``want``'s (relative)."""
    for name, a, b in zip(NAMES, got, want, strict=True):
        if not bool(torch.isfinite(a).all()):
            raise RuntimeError(f"the trial call returned non-finite values ({call} {name})")
        error = relative_error(a, b)
        if not error <= tol:
            raise RuntimeError(f"the trial call's {call} {name} is off the float64 reference by {error:.1e} "
                               f"(relative; tolerance {tol:.0e}): the kernel computes something else here")


def _varlen(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
            segments: VarlenSegments, scale: float) -> tuple[torch.Tensor, ...]:
    out, lse = kernel.varlen_forward(q, k, v, segments, True, scale)
    return (out, lse, *kernel.varlen_backward(BackwardRows(dout, q, out, lse), k, v, segments, True, scale))


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
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return all(relative_error(a, b) <= tol for a, b in zip(got, want, strict=True))


def _forward_backward(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    out, lse = kernel.forward(q, k, v, True, scale)
    return (out, lse, *kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, scale))
