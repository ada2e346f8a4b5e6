"""The ring with kernels whose outputs have CUDA's memory layouts, on CPU thread ranks.

CUDA kernels return lse ``[B, H, S]`` underneath (flash; cuDNN ``[B, H, S, 1]``; efficient padded), so the ring's
``[B, S, H]`` transpose of it is not contiguous; the float64 math kernel's gradients are head-major too. The CPU
flash kernel's outputs are laid out rows first, which hid a running lse that a varlen step flattened into a copy
and updated there (B > 1, unpacked plan, a local block inside one document). ``HeadMajor`` is the CPU kernel
with its outputs re-laid out head-major: same values, CUDA's strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cp_train.parallel.cp.ring.varlen_steps import flat_view
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels.contract import BackwardRows, OutLse, QKVGrads
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from tests import ring_cases
from tests.document_cases import masked_reference
from tests.numerics import rel_err
from tests.ring_threads import run_threaded_ring

TOL = 2e-6  # fp32 against float64: these cases measure about 2e-7


def head_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, S, H, ...]`` with the same values laid out ``[B, H, S, ...]`` underneath (not contiguous)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@dataclass(frozen=True)
class HeadMajor(TorchCpuFlash):
    """The CPU flash kernel returning a dense ``[B, H, S]`` lse (CUDA's) and, with ``all_outputs``, out, dq, dk and
    dv head-major too (a layout the contract allows: the math kernel's gradients have it)."""

    all_outputs: bool = False
    name: str = "cpu flash, CUDA layouts"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> OutLse:
        out, lse = super().forward(q, k, v, causal, scale)
        return (head_major(out) if self.all_outputs else out), lse.contiguous()

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> QKVGrads:
        grads = super().backward(rows, k, v, causal, scale)
        return tuple(head_major(g) for g in grads) if self.all_outputs else grads


def _documents(batch: int, seqlen: int, uniform: bool) -> torch.Tensor:
    """``[batch, seqlen]`` document ids: one long document between two short ones in every sample (``uniform``:
    an unpacked plan whose middle ranks' local blocks lie inside one document), or different per sample."""
    docs = torch.zeros(batch, seqlen, dtype=torch.long)
    docs[:, 4:] = 1
    docs[:, seqlen - 4:] = 2
    if not uniform:
        docs[1, 20:] += 1
    return docs


@pytest.mark.parametrize("all_outputs", [False, True])
@pytest.mark.parametrize("varlen", [True, False])
@pytest.mark.parametrize("uniform", [True, False])
def test_ring_with_cuda_layouts_matches_float64(all_outputs: bool, varlen: bool, uniform: bool) -> None:
    """cp 4 zigzag, two samples of documents: out, lse, dq, dk, dv within fp32 rounding of the float64 masked
    reference whatever the kernel's output strides (the varlen and the dense steps)."""
    world, seqlen = 4, 64
    q, k, v, dout = ring_cases.full_inputs(seqlen, 4, 2, 16, seed=7)
    docs = _documents(2, seqlen, uniform)
    spec = AttentionSpec("ring", "zigzag", True, 0.25, HeadMajor(all_outputs=all_outputs), 2, True, varlen=varlen)
    got = run_threaded_ring(q, k, v, dout, world, spec, docs)
    ref = masked_reference(q, k, v, dout, docs, True, 0.25)
    errors = {name: rel_err(got[name], value) for name, value in ref.items()}
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("forward_chunks,backward_chunks", [(2, 2), (1, 2)])
def test_head_chunks_with_cuda_layouts_match_float64(forward_chunks: int, backward_chunks: int) -> None:
    """Head chunks write into head slices of the running out/lse and dq: exact with head-major kernel outputs."""
    world, seqlen = 4, 64
    q, k, v, dout = ring_cases.full_inputs(seqlen, 4, 2, 16, seed=8)
    docs = _documents(2, seqlen, True)
    spec = AttentionSpec("ring", "zigzag", True, 0.25, HeadMajor(all_outputs=True), backward_chunks, True, varlen=True,
                         forward_head_chunks=forward_chunks)
    got = run_threaded_ring(q, k, v, dout, world, spec, docs)
    ref = masked_reference(q, k, v, dout, docs, True, 0.25)
    errors = {name: rel_err(got[name], value) for name, value in ref.items()}
    assert max(errors.values()) <= TOL, errors


def test_the_stand_in_has_cuda_layouts_and_the_cpu_kernel_does_not() -> None:
    """The premise: the CPU kernel's lse is rows first underneath (its transpose is contiguous), the stand-in's
    is head-major like CUDA's; the values are the same."""
    q, k, v, _ = ring_cases.full_inputs(16, 4, 2, 16, seed=1)
    out, lse = TorchCpuFlash().forward(q, k, v, True, 0.25)
    cuda_out, cuda_lse = HeadMajor(all_outputs=True).forward(q, k, v, True, 0.25)
    assert lse.transpose(1, 2).is_contiguous() and not cuda_lse.transpose(1, 2).is_contiguous()
    assert out.is_contiguous() and not cuda_out.is_contiguous()
    assert torch.equal(lse, cuda_lse) and torch.equal(out, cuda_out)


def test_flat_view_refuses_a_tensor_it_would_copy() -> None:
    """A running accumulator whose rows cannot merge into a view raises instead of being written as a copy."""
    lse = torch.zeros(2, 4, 8).transpose(1, 2)  # [B, n, H] over a [B, H, n] tensor
    with pytest.raises(RuntimeError):
        flat_view(lse)
    out = torch.zeros(2, 8, 4, 3)[:, :, 1:3]  # a head chunk of a contiguous accumulator: a view
    flat_view(out).fill_(1.0)
    assert out.eq(1.0).all()
