"""cuDNN declining a dense call after admission (``parallel/kernels/cudnn.py``: ``CudnnAttention.refused``): that
call shape runs on the varlen kernel's dense entry from then on, exact, with one warning; other errors propagate.

The cuDNN ops are the schema-checking CPU stand-ins of ``test_kernels_cudnn.py``, made to raise PyTorch's message
("cuDNN Frontend error: No valid execution plans built", as reported on H200 and GH200) for one query length.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cp_train.parallel.kernels import cudnn
from cp_train.parallel.kernels.contract import BackwardRows
from cp_train.parallel.kernels.select import MathKernel
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from tests.numerics import rel_err
from tests.parallel.test_kernels_cudnn import GQA, standin_backward, standin_forward

MATH = MathKernel()
DECLINED = 24  # the query length the stand-ins refuse
REFUSAL = "cuDNN Frontend error: No valid execution plans built"


@pytest.fixture
def declining_ops(monkeypatch) -> list[tuple[str, int]]:
    """Stand-in ops that refuse ``DECLINED`` query rows; returns the (op, query rows) of every call they got."""
    calls: list[tuple[str, int]] = []

    def op(name: str, standin, query_at: int):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN202
            rows = args[query_at].shape[2]  # [B, H, S, D]
            calls.append((name, rows))
            if rows == DECLINED:
                raise RuntimeError(f"{REFUSAL}\nException raised from run_cudnn_SDP_fprop")
            return standin(*args, **kwargs)
        return call

    monkeypatch.setattr(cudnn, "FORWARD", op("forward", standin_forward, 0))
    monkeypatch.setattr(cudnn, "BACKWARD", op("backward", standin_backward, 1))
    monkeypatch.setitem(GQA, "native", False)
    return calls


def _blocks(rows: int, keys: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rows)
    q, dout = (torch.randn(2, rows, 4, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, keys, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def _attention(kernel: cudnn.CudnnAttention, rows: int, keys: int, causal: bool) -> float:
    """One forward and backward against float64 math: the largest relative error."""
    q, k, v, dout = _blocks(rows, keys)
    out, lse = kernel.forward(q, k, v, causal, 0.25)
    grads = kernel.backward(BackwardRows(dout, q, out, lse), k, v, causal, 0.25)
    ref_out, ref_lse = MATH.forward(q, k, v, causal, 0.25)
    refs = MATH.backward(BackwardRows(dout, q, None, None), k, v, causal, 0.25)
    return max(rel_err(out, ref_out), rel_err(lse, ref_lse), *(rel_err(g, r) for g, r in zip(grads, refs,
                                                                                             strict=True)))


def test_a_declined_shape_runs_on_the_varlen_kernel_from_then_on(declining_ops) -> None:
    kernel = cudnn.CudnnAttention(varlen_kernel=TorchCpuFlash())
    with pytest.warns(RuntimeWarning) as caught:
        assert _attention(kernel, DECLINED, DECLINED, True) < 1e-12
    assert [str(w.message) for w in caught] == [
        f"cuDNN declined the attention {op} of q [2, 24, 4, 16] and k [2, 24, 2, 16] (causal True; {REFUSAL}): "
        f"that call shape runs on torch cpu flash from now on" for op in ("forward", "backward")]
    assert declining_ops == [("forward", DECLINED), ("backward", DECLINED)]
    assert kernel.refused == {(op, torch.Size([2, 24, 4, 16]), torch.Size([2, 24, 2, 16]), True)
                              for op in ("forward", "backward")}

    declining_ops.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and cuDNN is not asked again for that shape
        assert _attention(kernel, DECLINED, DECLINED, True) < 1e-12
        assert _attention(kernel, 32, 32, True) < 1e-12  # another shape still goes to cuDNN
        assert _attention(kernel, 16, 48, False) < 1e-12
    assert declining_ops == [("forward", 32), ("backward", 32), ("forward", 16), ("backward", 16)]
    assert len(kernel.refused) == 2 and hash(kernel) == hash(cudnn.CudnnAttention(varlen_kernel=TorchCpuFlash()))


def test_other_errors_and_a_kernel_without_a_fallback_raise(declining_ops, monkeypatch) -> None:
    q, k, v, _ = _blocks(DECLINED, DECLINED)
    with pytest.raises(RuntimeError, match="^cuDNN Frontend error: No valid execution plans built"):
        cudnn.CudnnAttention().forward(q, k, v, True, 0.25)  # no varlen kernel to run it

    def failed(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cudnn, "FORWARD", failed)
    kernel = cudnn.CudnnAttention(varlen_kernel=TorchCpuFlash())
    with pytest.raises(RuntimeError, match="^CUDA error: an illegal memory access"):
        kernel.forward(*_blocks(32, 32)[:3], True, 0.25)
    assert kernel.refused == set()
