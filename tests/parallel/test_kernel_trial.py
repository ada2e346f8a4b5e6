"""The admission trial (``parallel/kernels/trial.py``) on CPU: the real kernels pass it; a kernel that returns
finite but wrong results is refused with a message naming the result, and ``select_kernel`` then falls back to
the next backend with its one warning."""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.reference import MathKernel
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from cp_train.parallel.kernels.trial import trial_call

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class ShiftedLse(TorchCpuFlash):
    """Right out and gradients, lse off by 0.5 (a wrong scale or log base in lse would look like this)."""

    def forward(self, q, k, v, causal, scale):  # noqa: ANN001, ANN201
        out, lse = super().forward(q, k, v, causal, scale)
        return out, lse + 0.5


class ScaledOut(TorchCpuFlash):
    def forward(self, q, k, v, causal, scale):  # noqa: ANN001, ANN201
        out, lse = super().forward(q, k, v, causal, scale)
        return out * 1.1, lse


class SwappedGrads(TorchCpuFlash):
    """dK and dV swapped (same shapes, finite)."""

    def backward(self, rows, k, v, causal, scale):  # noqa: ANN001, ANN201
        dq, dk, dv = super().backward(rows, k, v, causal, scale)
        return dq, dv, dk


class WrongVarlenKeys(TorchCpuFlash):
    """Varlen calls that read each segment's keys at its query offsets (the dense calls right): wrong wherever a
    segment has more keys than rows."""

    def varlen_forward(self, q, k, v, segments, causal, scale):  # noqa: ANN001, ANN201
        bounds = [int(x) for x in segments.cu_k]
        return super().varlen_forward(q, k[:bounds[-1]], v[:bounds[-1]], segments._replace(cu_k=segments.cu_q),
                                      causal, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_real_cpu_kernels_pass(dtype: torch.dtype, head_dim: int) -> None:
    trial_call(TorchCpuFlash(), CPU, dtype, head_dim)
    trial_call(MathKernel(), CPU, dtype, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel,message", [
    (ShiftedLse(), "dense lse is off the float64 reference"), (ScaledOut(), "dense out is off"),
    (SwappedGrads(), "dense dk is off"), (WrongVarlenKeys(), "varlen out is off")])
def test_finite_but_wrong_results_are_refused(kernel: TorchCpuFlash, message: str, dtype: torch.dtype) -> None:
    with pytest.raises(RuntimeError, match=message + r".*\(relative; tolerance") as caught:
        trial_call(kernel, CPU, dtype, 16)
    assert "computes something else" in str(caught.value)


def test_the_trial_uses_gqa_with_expanding_copies() -> None:
    """4 query heads on 2 K/V heads: the path models with grouped K/V take (not ``expand_kv``'s stride-0 view of
    a single K/V head), in the dense and the varlen calls."""
    seen = []

    class Recording(TorchCpuFlash):
        def forward(self, q, k, v, causal, scale):  # noqa: ANN001, ANN201
            seen.append((q.shape[2], k.shape[2]))
            return super().forward(q, k, v, causal, scale)

    trial_call(Recording(), CPU, torch.float32, 16)
    assert seen and set(seen) == {(4, 2)}


@pytest.fixture
def cuda_without_packages(monkeypatch):
    """An sm80 GPU without flash-attn, FA3 or cuDNN; the trial calls run on CPU stand-ins of the backends."""
    def clear() -> None:
        kernels.select_kernel.cache_clear()
        kernels._warn_once.cache_clear()
        kernels._TRIALS.clear()
        kernels._CHOSEN.clear()

    clear()
    monkeypatch.setattr(kernels, "_import_flash_attn", lambda: "flash_attn is not installed")
    monkeypatch.setattr(kernels, "_import_fa3", lambda: "flash_attn_interface is not installed")
    monkeypatch.setattr(kernels, "_cudnn_unavailable", lambda: "torch 2.x was built without cuDNN")
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (8, 0))
    yield monkeypatch
    clear()


def test_a_refused_backend_falls_back_with_one_warning(cuda_without_packages) -> None:
    """PyTorch's CUDA flash kernel 'returning' a shifted lse fails the real trial; the efficient kernel is next."""
    tried = []

    def trial(kernel, device, dtype, head_dim) -> None:  # noqa: ANN001
        tried.append(kernel.name)
        trial_call(ShiftedLse() if kernel.name == "torch cuda flash" else TorchCpuFlash(), CPU, dtype, head_dim)

    cuda_without_packages.setattr(kernels, "_trial", trial)
    with pytest.warns(RuntimeWarning, match=r"backend 'torch' failed its trial call on cuda:0 with torch.bfloat16 "
                                            r"and head_dim 64 \(RuntimeError: the trial call's dense lse is off the "
                                            r"float64 reference by .*; using the next attention backend"):
        assert kernels.select_kernel(CUDA, torch.bfloat16, 64).name == "torch efficient"
    assert tried == ["torch cuda flash", "torch efficient"]
    with pytest.raises(kernels.KernelUnavailable, match="dense lse is off the float64 reference"):
        kernels.select_kernel(CUDA, torch.bfloat16, 64, "torch")
