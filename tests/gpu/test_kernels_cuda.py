"""Every attention backend present on this GPU against the float64 math kernel on CUDA.

out, lse, dq, dk, dv; bf16, fp16 and fp32; causal and non-causal; square and the ring's rectangular
blocks; GQA; batch 2; row-sliced views as the ring passes them. The reference is computed in float64
from the same (rounded) inputs, so the tolerances measure the kernel alone.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from tests.numerics import rel_err

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# relative error bounds (out and lse, gradients) per input dtype
TOL = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (4e-3, 1e-2), torch.float32: (2e-5, 1e-4)}
SHAPES = [(256, 256, True), (256, 256, False), (128, 256, False), (256, 128, False), (200, 200, True)]


def _available(backend: str, dtype: torch.dtype, head_dim: int):
    try:
        return kernels.select_kernel(torch.device("cuda"), dtype, head_dim, backend)
    except kernels.KernelUnavailable as error:
        pytest.skip(str(error))


def _inputs(sq: int, sk: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda s, h: torch.randn(2, s, h, head_dim, generator=gen, device="cuda").to(dtype)  # noqa: E731
    q = torch.cat([make(sq, heads), make(sq, heads)], dim=1)[:, ::2]  # a strided, row-sliced view
    return q, make(sk, kv_heads), make(sk, kv_heads), make(sq, heads)


@pytest.mark.parametrize("backend", ["torch", "torch_efficient", "cudnn", "flash_attn", "fa3"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("sq,sk,causal", SHAPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 128)])
def test_backend_matches_float64(backend, dtype_name, sq, sk, causal, heads, kv_heads, head_dim) -> None:
    dtype = DTYPES[dtype_name]
    kernel = _available(backend, dtype, head_dim)
    if causal and sq != sk:
        pytest.skip("the ring uses causal masks on square blocks only")
    q, k, v, dout = _inputs(sq, sk, heads, kv_heads, head_dim, dtype, seed=sq + sk)
    scale = head_dim ** -0.5
    math = kernels.MathKernel()
    ref_out, ref_lse = math.forward(q, k, v, causal, scale)
    ref_grads = math.backward(BackwardRows(dout, q, ref_out, ref_lse), k, v, causal, scale)
    out, lse = kernel.forward(q, k, v, causal, scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (2, heads, sq) and lse.dtype == torch.float32
    tol_out, tol_grad = TOL[dtype]
    assert rel_err(out, ref_out) < tol_out, f"out {rel_err(out, ref_out):.2e}"
    assert rel_err(lse, ref_lse) < tol_out, f"lse {rel_err(lse, ref_lse):.2e}"
    # the ring hands the backward its merged lse as a [B, H, n] view of a [B, n, H] buffer
    ring_lse = ref_lse.float().transpose(1, 2).contiguous().transpose(1, 2)
    grads = kernel.backward(BackwardRows(dout, q, ref_out.to(dtype), ring_lse), k, v, causal, scale)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert got.shape == ref.shape, name
        assert rel_err(got, ref) < tol_grad, f"{name} {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("backend,dtype", [("torch", torch.bfloat16), ("torch_efficient", torch.float32),
                                           ("flash_attn", torch.bfloat16), ("fa3", torch.bfloat16)])
def test_deterministic_backward_is_bitwise_repeatable(backend: str, dtype: torch.dtype) -> None:
    try:
        kernel = kernels.select_kernel(torch.device("cuda"), dtype, 64, backend, True)
    except kernels.KernelUnavailable as error:
        pytest.skip(str(error))
    q, k, v, dout = _inputs(1024, 1024, 8, 2, 64, dtype, seed=1)
    out, lse = kernel.forward(q, k, v, True, 0.125)
    first = kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, 0.125)
    for _ in range(3):
        again = kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, 0.125)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_automatic_choice_on_this_gpu() -> None:
    cuda = torch.device("cuda")
    assert kernels.select_kernel(cuda, torch.float32, 64).name == "torch efficient"
    assert kernels.select_kernel(cuda, torch.float64, 64).name == "math"
    assert kernels.select_kernel(cuda, torch.bfloat16, 64).name in ("fa3", "cudnn", "torch cuda flash") or \
        kernels.select_kernel(cuda, torch.bfloat16, 64).name.startswith("flash_attn")


@pytest.mark.parametrize("backend", ["torch", "torch_efficient", "cudnn", "flash_attn", "fa3"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_float64(backend: str, dtype_name: str, causal: bool) -> None:
    """Packed segments (bottom-right causal rectangles or full), GQA, as the ring's varlen steps call them."""
    dtype = DTYPES[dtype_name]
    kernel = _available(backend, dtype, 64)
    rows, keys = [64, 1, 200, 37], [64, 9, 456, 37]
    gen = torch.Generator(device="cuda").manual_seed(9)
    make = lambda n, h: torch.randn(n, h, 64, generator=gen, device="cuda").to(dtype)  # noqa: E731
    q, dout, k, v = make(sum(rows), 8), make(sum(rows), 8), make(sum(keys), 2), make(sum(keys), 2)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in (rows, keys))
    args = (VarlenSegments(cu_q, cu_k, max(rows), max(keys)), causal, 0.125)
    math = kernels.MathKernel()
    ref_out, ref_lse = math.varlen_forward(q, k, v, *args)
    ref_grads = math.varlen_backward(BackwardRows(dout, q, ref_out, ref_lse), k, v, *args)
    out, lse = kernel.varlen_forward(q, k, v, *args)
    tol_out, tol_grad = TOL[dtype]
    assert lse.shape == (8, sum(rows)) and rel_err(lse, ref_lse) < tol_out
    assert rel_err(out, ref_out) < tol_out
    grads = kernel.varlen_backward(BackwardRows(dout, q, ref_out.to(dtype), ref_lse.float()), k, v, *args)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert rel_err(got, ref) < tol_grad, f"{name} {rel_err(got, ref):.2e}"


def test_a_shape_cudnn_declines_runs_on_its_varlen_kernel(monkeypatch) -> None:
    """cuDNN made to decline one query length on the device (``cudnn.REFUSAL``): that shape's forward and backward
    run on the kernel behind cuDNN's varlen calls (this GPU's), matching float64, one warning each; another shape
    still runs on cuDNN."""
    from cp_train.parallel.kernels import cudnn

    kernel = _available("cudnn", torch.bfloat16, 128)
    real_forward, real_backward, seen = cudnn.FORWARD, cudnn.BACKWARD, []

    def declining(real, query_at: int):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN202
            seen.append(args[query_at].shape[2])
            if args[query_at].shape[2] == 200:
                raise RuntimeError(f"{cudnn.REFUSAL}: No valid execution plans built")
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(cudnn, "FORWARD", declining(real_forward, 0))
    monkeypatch.setattr(cudnn, "BACKWARD", declining(real_backward, 1))
    math, scale = kernels.MathKernel(), 128 ** -0.5
    try:
        for sq, warned in ((200, True), (200, False), (256, False)):
            q, k, v, dout = _inputs(sq, sq, 8, 2, 128, torch.bfloat16, seed=sq)
            with pytest.warns(RuntimeWarning, match="cuDNN declined") if warned else contextlib.nullcontext():
                out, lse = kernel.forward(q, k, v, True, scale)
                grads = kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, scale)
            ref_out, ref_lse = math.forward(q, k, v, True, scale)
            refs = math.backward(BackwardRows(dout, q, ref_out, ref_lse), k, v, True, scale)
            assert rel_err(out, ref_out) < TOL[torch.bfloat16][0] and rel_err(lse, ref_lse) < TOL[torch.bfloat16][0]
            assert all(rel_err(g, r) < TOL[torch.bfloat16][1] for g, r in zip(grads, refs, strict=True))
        assert seen == [200, 200, 256, 256]  # the declined shape was offered once per direction, never again
    finally:
        kernel.refused.clear()  # the kernel is shared by the process's later tests
