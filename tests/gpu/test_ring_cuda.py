"""The ring's CUDA code path on one GPU, its ranks as threads (see tests/ring_threads.py).

Exact in fp32 (efficient attention) against the float64 reference; in bf16 within twice the error of
the same kernel on the whole sequence; with both overlap policies. NCCL itself is exercised by
``torchrun --nproc-per-node N -m tests.gpu.ring_nccl`` on a multi-GPU node.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.cp.layout import STATIC_LAYOUTS
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import BackwardRows
from cp_train.parallel.kernels.torch_ops import expand_kv
from tests.numerics import rel_err
from tests.ring_threads import run_threaded_ring


def _full(seqlen: int, dtype: torch.dtype, heads: int = 8, kv_heads: int = 2, head_dim: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(seqlen)
    make = lambda h: torch.randn(2, seqlen, h, head_dim, generator=gen, device="cuda").to(dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), make(heads)


def _reference(q, k, v, dout, causal: bool, scale: float) -> dict[str, torch.Tensor]:
    math = kernels.MathKernel()
    out, lse = math.forward(q, k, v, causal, scale)
    grads = math.backward(BackwardRows(dout, q, out, lse), k, v, causal, scale)
    return {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads, strict=True))}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", STATIC_LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_fp32_ring_on_cuda_is_exact(world: int, layout: str, causal: bool, overlap: bool) -> None:
    q, k, v, dout = _full(64 * world, torch.float32)
    kernel = kernels.select_kernel(q.device, q.dtype, 64)
    got = run_threaded_ring(q, k, v, dout, world, AttentionSpec("ring", layout, causal, 0.125, kernel, 2, overlap))
    ref = _reference(q, k, v, dout, causal, 0.125)
    for name, value in ref.items():
        assert rel_err(got[name], value) < 2e-5, f"{name}: {rel_err(got[name], value):.2e}"


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (4, "zigzag"), (4, "stripe"), (2, "contiguous")])
def test_bf16_ring_on_cuda_within_twice_the_local_kernel(world: int, layout: str) -> None:
    q, k, v, dout = _full(256 * world, torch.bfloat16)
    kernel = kernels.select_kernel(q.device, q.dtype, 64)
    ref = _reference(q, k, v, dout, True, 0.125)
    local = run_threaded_ring(q, k, v, dout, 1, AttentionSpec("ring", layout, True, 0.125, kernel, 2, True))
    ring = run_threaded_ring(q, k, v, dout, world, AttentionSpec("ring", layout, True, 0.125, kernel, 2, True))
    for name in ("out", "dq", "dk", "dv"):
        ring_error = rel_err(ring[name].to(q.dtype), ref[name])
        local_error = rel_err(local[name].to(q.dtype), ref[name])
        assert ring_error <= 2 * local_error + 1e-4, f"{name}: ring {ring_error:.2e} vs local {local_error:.2e}"


@pytest.mark.parametrize("world,layout,uniform", [(2, "zigzag", False), (4, "stripe", False),
                                                  (4, "contiguous", False), (4, "zigzag", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_documents_ring_on_cuda_with_varlen_steps(world: int, layout: str, uniform: bool, dtype: torch.dtype) -> None:
    """Packed documents: every step with several segments runs as varlen calls on the GPU kernels. ``uniform``: both
    samples share one long document between two short ones (an unpacked plan; a local block inside the long one is
    one dense call whose lse, [B, H, S] underneath, starts the running lse a later varlen step writes into)."""
    q, k, v, dout = _full(128 * world, dtype)
    gen = torch.Generator().manual_seed(world)
    starts = torch.rand(2, 128 * world, generator=gen) < 0.05
    starts[:, 0] = False
    if uniform:
        starts.zero_()
        starts[:, 4] = starts[:, -4] = True
    docs = torch.cumsum(starts.long(), 1)
    kernel = kernels.select_kernel(q.device, q.dtype, 64)
    spec = AttentionSpec("ring", layout, True, 0.125, kernel, 2, True, varlen=True)
    got = run_threaded_ring(q, k, v, dout, world, spec, docs)
    visible = (docs[:, :, None] == docs[:, None, :]) & torch.ones(128 * world, 128 * world, dtype=torch.bool).tril()
    scores_mask = visible.cuda()[:, None]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, expand_kv(k64, 8)) * 0.125
    scores = scores.masked_fill(~scores_mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), expand_kv(v64, 8))
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    bound = 2e-5 if dtype == torch.float32 else 5e-2
    for name, ref in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert rel_err(got[name], ref) < bound, f"{name}: {rel_err(got[name], ref):.2e}"


def test_packed_documents_give_cudnn_only_the_layouts_shapes() -> None:
    """cp 4 zigzag, bf16, lognormal documents: the dense shapes the selected kernel is given (one cuDNN graph
    each, forward and backward apart) are the layout's block shapes, at most 8 over every micro-batch; the steps
    the documents shape are varlen calls."""
    from bench.cudnn_graphs import lognormal_documents
    from cp_train.parallel.cp.plan.routing import layout_shapes

    world, seqlen = 4, 2048
    kernel = kernels.select_kernel(torch.device("cuda"), torch.bfloat16, 64)
    shapes: set = set()

    class Recording:  # the selected kernel, recording its dense shapes
        name, native_varlen = kernel.name, kernel.native_varlen

        def forward(self, q, k, v, causal, scale):  # noqa: ANN001
            shapes.add(("forward", q.shape[1], k.shape[1], causal))
            return kernel.forward(q, k, v, causal, scale)

        def backward(self, rows, k, v, causal, scale):  # noqa: ANN001
            shapes.add(("backward", rows.q.shape[1], k.shape[1], causal))
            return kernel.backward(rows, k, v, causal, scale)

        def __getattr__(self, name):  # noqa: ANN001, ANN204
            return getattr(kernel, name)

    spec = AttentionSpec("ring", "zigzag", True, 0.125, Recording(), 2, True, varlen=True)
    q, k, v, dout = (x[:1] for x in _full(seqlen, torch.bfloat16))
    for docs in lognormal_documents(seqlen, 12, seed=5):
        run_threaded_ring(q, k, v, dout, world, spec, docs[None])
    assert len({s[1:] for s in shapes}) <= 8 and {s[1:3] for s in shapes} <= layout_shapes(seqlen // world)


def test_cudnn_meets_no_new_graph_after_the_first_step_with_packed_documents() -> None:
    """cp 4 zigzag rank threads that persist (as a rank's do), a new sample of lognormal documents per step: with
    the ring's warm-up every dense key cuDNN's graph cache sees is first seen at step 1 (``bench.cudnn_graphs``)."""
    import argparse

    from bench import cudnn_graphs

    args = argparse.Namespace(device="cuda", dtype="bfloat16", world=4, layout="zigzag", seqlen=4096, steps=6,
                              heads=8, kv_heads=2, head_dim=64, seed=0, no_warm=False, plans_per_shape=False)
    summary = cudnn_graphs.run(args)[-1]
    if summary["kernel"] != "cudnn":
        pytest.skip(f"the selected kernel is {summary['kernel']}, not cuDNN")
    assert summary["keys"] > 0 and summary["new_after_step_1"] == 0, summary
