"""The ring's warm-up of per-shape kernel plans (``parallel/cp/ring/warm.py``) and the cuDNN op view's batch
stride (CPU; the keys are those cuDNN's graph cache would see).

The warm-up runs only on kernels with ``plans_per_shape`` (cuDNN); here the CPU flash kernel is counted as one.
"""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from bench import cudnn_graphs
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels import cudnn
from cp_train.parallel.kernels.cudnn import op_view
from tests.parallel.test_kernel_shapes import NativeVarlen
from tests.parallel.test_kernels_cudnn import GQA, standin_backward, standin_forward
from tests.ring_threads import run_threaded_ring
from tests.warmup_cases import new_keys_by_step


def _args(layout: str, world: int, no_warm: bool) -> argparse.Namespace:
    return argparse.Namespace(device="cpu", dtype="float32", world=world, layout=layout, seqlen=1024, steps=8,
                              heads=4, kv_heads=2, head_dim=16, seed=0, no_warm=no_warm, plans_per_shape=True)


@pytest.mark.parametrize("layout,world", [("zigzag", 4), ("stripe", 4), ("contiguous", 4), ("zigzag", 1)])
def test_every_dense_key_is_built_at_the_first_step(layout: str, world: int) -> None:
    """Persistent rank threads, a new sample of lognormal documents per step: with the warm-up every key the
    dense calls use (thread, shape, strides past the batch, causal) is first seen at step 1."""
    summary = cudnn_graphs.run(_args(layout, world, no_warm=False))[-1]
    assert summary["keys"] > 0 and summary["new_after_step_1"] == 0, summary
    assert not hasattr(type(cudnn_graphs.kernels.select_kernel(torch.device("cpu"), torch.float32, 16)),
                       "plans_per_shape")  # the bench put the class back


def test_without_the_warm_up_keys_appear_late() -> None:
    """The control: the same run without the warm-up meets new dense keys after step 1 (what would stall a
    cuDNN rank for a graph build at a late step)."""
    summary = cudnn_graphs.run(_args("zigzag", 4, no_warm=True))[-1]
    assert summary["new_after_step_1"] > 0, summary
    assert warm.ENABLED


class WarmedNativeVarlen(NativeVarlen):
    plans_per_shape = True


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_warm_up_leaves_the_results_bitwise(layout: str) -> None:
    """The warm calls' results are dropped: out, lse and the gradients are bitwise those without them."""
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 512, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 512, 2, 16, generator=gen) for _ in range(2))
    docs = cudnn_graphs.lognormal_documents(512, 1, seed=4, median=96)
    results = {}
    for kernel in (NativeVarlen(), WarmedNativeVarlen()):
        spec = AttentionSpec("ring", layout, True, 0.25, kernel, 2, True, varlen=True)
        results[type(kernel).__name__] = run_threaded_ring(q, k, v, dout, 4, spec, docs)
    plain, warmed = results["NativeVarlen"], results["WarmedNativeVarlen"]
    for name in plain:
        assert torch.equal(plain[name], warmed[name]), name


def test_op_view_gives_a_row_slice_the_strides_of_its_own_block() -> None:
    block = torch.randn(1, 8, 4, 16)
    part, own = block[:, 2:6], block[:, 2:6].clone()
    assert op_view(part).stride() == op_view(own).stride()
    assert torch.equal(op_view(part), part.transpose(1, 2))
    two = torch.randn(2, 8, 4, 16)[:, 2:6]
    assert op_view(two).stride() == two.transpose(1, 2).stride()  # the batch stride is stepped: kept


@pytest.mark.parametrize("warmed", [True, False])
def test_the_cudnn_ops_see_no_new_graph_key_after_the_first_step(monkeypatch: pytest.MonkeyPatch,
                                                                 warmed: bool) -> None:
    """``CudnnAttention`` itself (its op views, GQA without copies) on the ring's warm-up, the ops replaced by
    stand-ins bound to the real schemas that record cuDNN's graph key (the thread and every operand's sizes and
    strides, causal, scale; the backward's out, grad_out and lse too; outputs laid out as cuDNN lays them): with
    the warm-up every key is first seen at step 1; without it (the control) some only later."""
    keys = cudnn_graphs.DenseKeys()
    first: dict[tuple, int] = {}

    def key_of(kind: str, tensors: tuple, causal: bool, scale: float) -> None:
        key = (threading.get_ident(), kind, *((tuple(x.shape), x.stride()) for x in tensors), causal, scale)
        first.setdefault(key, keys.step)

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        key_of("forward", args[:3], args[6], kwargs["scale"])
        return standin_forward(*args, **kwargs)

    def backward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        key_of("backward", args[:6], args[14], kwargs["scale"])
        return standin_backward(*args, **kwargs)

    monkeypatch.setattr(cudnn, "FORWARD", forward)
    monkeypatch.setattr(cudnn, "BACKWARD", backward)
    monkeypatch.setitem(GQA, "native", True)
    kernel = cudnn.CudnnAttention(varlen_kernel=NativeVarlen(), native_gqa=True)
    args = _args("zigzag", 4, no_warm=not warmed)
    args.seqlen = 2048
    summary = cudnn_graphs.run(args, kernel=kernel, keys=keys)[-1]
    assert summary["kernel"] == "cudnn" and first, summary
    assert (max(first.values()) == 1) == warmed, sorted(first.values())


@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
def test_spawned_ranks_build_every_key_at_the_first_step(spawn_world, algorithm: str) -> None:
    """cp 4 gloo ranks (the ring's P2P, the all-gather's collectives), new lognormal documents per step: with the
    warm-up every rank's dense keys are first seen at step 1; without it (the control) some rank's later."""
    warmed = spawn_world(4).run(new_keys_by_step, algorithm, "zigzag", 1024, 8, True, 128)
    assert all(sum(counts) > 0 and sum(counts[2:]) == 0 for counts in warmed), warmed
    plain = spawn_world(4).run(new_keys_by_step, algorithm, "zigzag", 1024, 8, False, 128)
    assert any(sum(counts[2:]) > 0 for counts in plain), plain
