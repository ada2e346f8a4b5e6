"""Kernel choice by device and dtype, head_dim checks, and the CUDA ops' call forms against their schemas.

No GPU is needed: selection never touches the device, the CUDA ops have meta kernels (shapes), and
calling an op with CPU tensors gets past argument parsing before failing for want of a CPU kernel,
so a call that does not bind to the op's schema fails differently.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from cp_train.parallel.kernels.select import KernelUnavailable, select_kernel
from cp_train.parallel.kernels.torch_ops import TorchCudaFlash, TorchEfficient, padded_lse

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def no_packages(monkeypatch):
    """As on a machine without flash-attn or FA3, with an sm80 GPU; caches cleared around each test."""
    for cached in (kernels.select_kernel, kernels._import_flash_attn, kernels._import_fa3):
        cached.cache_clear()
    monkeypatch.setattr(kernels, "_import_flash_attn", lambda: "flash_attn is not installed")
    monkeypatch.setattr(kernels, "_import_fa3", lambda: "flash_attn_interface is not installed")
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (8, 0))
    yield
    kernels.select_kernel.cache_clear()


@pytest.mark.parametrize("device,dtype,name", [
    ("cpu", torch.float32, "torch cpu flash"), ("cpu", torch.bfloat16, "torch cpu flash"),
    ("cpu", torch.float64, "torch cpu flash"), ("cuda", torch.bfloat16, "torch cuda flash"),
    ("cuda", torch.float16, "torch cuda flash"), ("cuda", torch.float32, "torch efficient"),
    ("cuda", torch.float64, "math")])
def test_automatic_choice_by_device_and_dtype(device: str, dtype: torch.dtype, name: str) -> None:
    assert select_kernel(torch.device(device), dtype, 64).name == name


def test_choice_is_made_once_per_device_dtype_and_head_dim() -> None:
    first = select_kernel(CUDA, torch.bfloat16, 64)
    assert select_kernel(CUDA, torch.bfloat16, 64) is first
    assert select_kernel(CUDA, torch.bfloat16, 128) is not first


def test_head_dim_outside_the_flash_kernels_goes_to_efficient_attention() -> None:
    assert select_kernel(CUDA, torch.bfloat16, 20).name == "torch efficient"  # not a multiple of 8
    assert select_kernel(CUDA, torch.bfloat16, 320).name == "torch efficient"  # above 256
    assert select_kernel(torch.device("cpu"), torch.float32, 20).name == "torch cpu flash"


@pytest.mark.parametrize("device,dtype,head_dim,backend,message", [
    ("cuda", torch.bfloat16, 20, "torch", r"head_dim a multiple of 8 and at most 256, got 20"),
    ("cuda", torch.bfloat16, 264, "torch", r"at most 256, got 264"),
    ("cuda", torch.float32, 64, "torch", r"takes float16/bfloat16 on CUDA, got torch.float32.*torch_efficient"),
    ("cuda", torch.float64, 64, "torch_efficient", r"use backend 'math' for float64"),
    ("cuda", torch.float32, 18, "torch_efficient", r"multiple of 4, got 18"),
    ("cpu", torch.float32, 64, "torch_efficient", r"needs CUDA tensors, got cpu"),
    ("cpu", torch.bfloat16, 64, "flash_attn", r"needs CUDA tensors"),
    ("cuda", torch.bfloat16, 64, "flash_attn", r"flash_attn is not installed; install cp-train\[gpu\]"),
    ("cuda", torch.bfloat16, 64, "fa3", r"flash_attn_interface is not installed"),
    ("cuda", torch.bfloat16, 64, "cudnn", r"unknown attention backend 'cudnn'"),
])
def test_a_named_backend_that_cannot_run_says_what_to_change(device, dtype, head_dim, backend, message) -> None:
    with pytest.raises(KernelUnavailable, match=message):
        select_kernel(torch.device(device), dtype, head_dim, backend)


def test_fa3_needs_hopper(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_import_fa3", lambda: object())
    with pytest.raises(KernelUnavailable, match="Hopper \\(sm90\\) GPUs only, this one is sm80"):
        select_kernel(CUDA, torch.bfloat16, 64, "fa3")


def test_no_kernel_at_all_is_one_clear_error() -> None:
    with pytest.raises(KernelUnavailable, match=r"no attention kernel runs torch.float16 with head_dim 6 on cuda"):
        select_kernel(CUDA, torch.float16, 6)


def _meta(batch, seqlen, heads, head_dim, dtype):
    return torch.empty(batch, seqlen, heads, head_dim, dtype=dtype, device="meta")


@pytest.mark.parametrize("sq,sk,kv_heads", [(100, 100, 8), (100, 228, 2), (64, 32, 1)])
def test_cuda_flash_calls_match_the_op_schemas(sq: int, sk: int, kv_heads: int) -> None:
    kernel = TorchCudaFlash(deterministic=True)
    q, dout = _meta(2, sq, 8, 64, torch.bfloat16), _meta(2, sq, 8, 64, torch.bfloat16)
    k, v = _meta(2, sk, kv_heads, 64, torch.bfloat16), _meta(2, sk, kv_heads, 64, torch.bfloat16)
    out, lse = kernel.forward(q, k, v, sq == sk, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, sq) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(BackwardRows(dout, q, out, lse.transpose(1, 2).transpose(1, 2)), k, v, sq == sk,
                                 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape  # GQA handled by the kernel
    assert not torch.are_deterministic_algorithms_enabled()  # switched on for the call only


@pytest.mark.parametrize("sq,sk,kv_heads", [(100, 100, 8), (100, 228, 2), (64, 32, 1)])
def test_efficient_attention_calls_match_the_op_schemas(sq: int, sk: int, kv_heads: int) -> None:
    kernel = TorchEfficient(deterministic=True)
    q, k = _meta(2, sq, 8, 64, torch.float32), _meta(2, sk, kv_heads, 64, torch.float32)
    out, lse = kernel.forward(q, k, k, False, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, sq)  # the padded rows sliced off
    # the backward's meta kernel is registered with a shifted signature, so bind against the CPU dispatcher
    q, k, dout = torch.zeros(2, sq, 8, 64), torch.zeros(2, sk, kv_heads, 64), torch.zeros(2, sq, 8, 64)
    with pytest.raises(NotImplementedError, match="_efficient_attention_backward' with arguments from the 'CPU'"):
        kernel.backward(BackwardRows(dout, q, torch.zeros_like(q), torch.zeros(2, 8, sq)), k, k, False, 0.125)
    with pytest.raises(NotImplementedError, match="_efficient_attention_forward' with arguments from the 'CPU'"):
        kernel.forward(q, k, k, True, 0.125)
    with pytest.raises(NotImplementedError, match="_flash_attention_backward' with arguments from the 'CPU'"):
        TorchCudaFlash().backward(BackwardRows(dout, q, q, torch.zeros(2, 8, sq)), k, k, True, 0.125)


def test_efficient_lse_is_padded_densely_for_the_backward() -> None:
    lse = torch.randn(2, 100, 3).transpose(1, 2)  # the ring's [B, n, H] accumulator, viewed [B, H, n]
    dense = padded_lse(lse)
    assert dense.shape == (2, 3, 128) and dense.is_contiguous()
    assert torch.equal(dense[:, :, :100], lse) and not dense[:, :, 100:].any()


def test_varlen_calls_match_the_op_schemas() -> None:
    """The CUDA kernels' varlen forms: packed [T, H, D] rows with int32 offsets (efficient attention's lse
    comes padded per segment and is unpadded to [H, T])."""
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="meta")
    q, dout = (torch.empty(300, 8, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    k = torch.empty(300, 2, 64, dtype=torch.bfloat16, device="meta")
    segments = VarlenSegments(cu, cu, 200, 200)
    flash = TorchCudaFlash()
    out, lse = flash.varlen_forward(q, k, k, segments, True, 0.125)
    assert out.shape == q.shape and lse.shape == (8, 300)
    dq, dk, dv = flash.varlen_backward(BackwardRows(dout, q, out, lse), k, k, segments, True, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape
    efficient = TorchEfficient()
    out, lse = efficient.varlen_forward(q.float(), k.float(), k.float(), segments, True, 0.125)
    assert out.shape == q.shape and lse.shape == (8, 300)
    cpu_cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    q, k = torch.zeros(300, 8, 64), torch.zeros(300, 2, 64)
    with pytest.raises(NotImplementedError, match="_efficient_attention_backward' with arguments from the 'CPU'"):
        efficient.varlen_backward(BackwardRows(q, q, q, torch.zeros(8, 300)), k, k,
                                  VarlenSegments(cpu_cu, cpu_cu, 200, 200), True, 0.125)
