"""The CUDA kernels' call forms against the ops' schemas, on the meta device (shapes) and the CPU dispatcher (a call
that binds to the schema fails for want of a CPU kernel, one that does not fails differently); no GPU needed."""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from cp_train.parallel.kernels.torch_ops import TorchCudaFlash, TorchEfficient, padded_lse


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
        kernel.forward(q, k, k, sq == sk, 0.125)
    with pytest.raises(NotImplementedError, match="_flash_attention_backward' with arguments from the 'CPU'"):
        TorchCudaFlash().backward(BackwardRows(dout, q, q, torch.zeros(2, 8, sq)), k, k, sq == sk, 0.125)


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
