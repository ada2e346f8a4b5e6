"""flash-attn call forms by version, against stand-ins with each release's exact signatures (CPU).

The stand-ins (``tests/flash_attn_standins.py``) compute with the float64 math kernel, so a call that
binds the wrong arguments fails with a TypeError (or, through a custom op, a schema error) and a
return unpacked at the wrong index fails numerically.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
import types

import pytest
import torch

from cp_train.parallel.cp.plan.rank_plan import plan_for_layout
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.spec import RING_SM_MARGIN, AttentionSpec, transfer_kernel
from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from cp_train.parallel.kernels.flash_attn import FlashAttn2, FlashAttn3, flash_attn_call_form, parameter_names
from tests import fa3_standins
from tests import flash_attn_standins as standins
from tests.numerics import rel_err

VERSIONS = ["2.5.9", "2.6.3", "2.7.4.post1", "2.8.3"]
# 2.5.7 added a required block_table; 2.6.1 gave it a default
VARLEN_VERSIONS = ["2.5.6", "2.5.9", "2.6.0.post1", "2.6.3", "2.7.4.post1", "2.8.3"]
MATH = kernels.MathKernel()


def _blocks(gen: torch.Generator, sq: int, sk: int, heads: int = 4, kv_heads: int = 2):
    q = torch.randn(2, sq, heads, 16, generator=gen)
    k, v = (torch.randn(2, sk, kv_heads, 16, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(2, sq, heads, 16, generator=gen)


def _check_kernel(kernel) -> None:
    """Square causal, square and rectangular non-causal blocks, GQA, row-sliced views: vs float64 math."""
    gen = torch.Generator().manual_seed(0)
    for sq, sk, causal in ((24, 24, True), (24, 24, False), (12, 24, False), (24, 12, False)):
        q, k, v, dout = _blocks(gen, sq, sk)
        q = torch.cat([q, q], dim=1)[:, ::2]  # a strided (row-sliced) view, as the ring passes
        out, lse = kernel.forward(q, k, v, causal, 0.25)
        ref_out, ref_lse = MATH.forward(q, k, v, causal, 0.25)
        assert out.shape == q.shape and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
        assert rel_err(out, ref_out) < 1e-6 and rel_err(lse, ref_lse) < 1e-6
        grads = kernel.backward(BackwardRows(dout, q, out, lse.transpose(1, 2).contiguous().transpose(1, 2)), k, v,
                                causal, 0.25)
        for got, ref in zip(grads, MATH.backward(BackwardRows(dout, q, None, None), k, v, causal, 0.25), strict=True):
            assert got.shape == ref.shape and rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("version,form", [("2.5.0", "2.5"), ("2.5.9.post1", "2.5"), ("2.6.0", "2.6"),
                                          ("2.6.3", "2.6"), ("2.7.0", "2.7"), ("2.7.4.post1", "2.7"),
                                          ("2.8.3", "2.7"), ("2.9.0", "2.7")])
def test_flash_attn_call_form_follows_the_version(version: str, form: str) -> None:
    assert flash_attn_call_form(version) == form


def test_flash_attn_too_old_or_unreadable_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"flash-attn 2.4.2 is too old.*>= 2.5"):
        flash_attn_call_form("2.4.2")
    with pytest.raises(ValueError, match="cannot read flash-attn version"):
        flash_attn_call_form("main")


@pytest.mark.parametrize("version", VERSIONS)
def test_flash_attn_calls_bind_and_unpack(version: str) -> None:
    interface = standins.flash_attn_interface(version)
    if version.startswith(("2.7", "2.8")):  # custom ops: the Python signature hides the arguments
        assert str(inspect.signature(interface._flash_attn_forward)) == "(*args, **kwargs)"
        assert "window_size_left" in parameter_names(interface._flash_attn_forward)
    kernel = FlashAttn2.load(interface, version, deterministic=True)
    assert kernel.name == f"flash_attn {version}"
    standins.CALLS.clear()
    _check_kernel(kernel)
    backward_calls = [c for c in standins.CALLS if c["fn"] == "bwd"]
    assert backward_calls and all(c["deterministic"] and c["lse_contiguous"] for c in backward_calls)


@pytest.mark.parametrize("form", ["custom_op", "plain"])
def test_fa3_flash_attn_interface_calls_bind_and_unpack(form: str) -> None:
    kernel = FlashAttn3.load(fa3_standins.fa3_interface(form), deterministic=True)
    expected = "is_causal" if form == "custom_op" else "causal"
    assert kernel.causal_name == expected
    standins.CALLS.clear()
    _check_kernel(kernel)
    assert all(c["deterministic"] for c in standins.CALLS if c["fn"] == "bwd")


def test_fa3_leaves_sms_to_cp_communication() -> None:
    """With more than one CP rank computing, FA3 runs with ``sm_margin`` (both ways); alone, or another kernel,
    unchanged."""
    kernel = FlashAttn3.load(fa3_standins.fa3_interface("plain"))
    one_rank, two_ranks = types.SimpleNamespace(areas=(10,)), types.SimpleNamespace(areas=(10, 10))
    assert transfer_kernel(kernel, None) is kernel and transfer_kernel(kernel, one_rank) is kernel
    cpu = kernels.select_kernel(torch.device("cpu"), torch.float32, 16)
    assert transfer_kernel(cpu, two_ranks) is cpu
    standins.CALLS.clear()
    _check_kernel(transfer_kernel(kernel, two_ranks))
    margins = [c["sm_margin"] for c in standins.CALLS]
    assert {c["fn"] for c in standins.CALLS} == {"fwd", "bwd"} and set(margins) == {RING_SM_MARGIN}


def test_fa3_flash_attn_interface_beta_is_refused() -> None:
    beta = types.ModuleType("flash_attn_interface")
    beta._flash_attn_forward = lambda q, k, v, softmax_scale, causal, window_size=(-1, -1), descale_q=None: None
    beta._flash_attn_backward = lambda dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal: None
    with pytest.raises(ValueError, match="FA3 beta from before 2025"):
        FlashAttn3.load(beta)


@pytest.mark.parametrize("version", ["2.5.9", "2.8.3"])
def test_ring_runs_through_the_flash_attn_call_forms(version: str) -> None:
    """The ring's own slicing (head chunks, row-sliced tasks, the merged lse) through a package kernel."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = _blocks(gen, 32, 32)
    kernel = FlashAttn2.load(standins.flash_attn_interface(version), version)
    spec = AttentionSpec("ring", "zigzag", True, 0.25, kernel, 2, False)
    plan = plan_for_layout("zigzag", True, 1, 0, 32)
    out, lse = ring_forward(q, k, v, None, spec, plan)
    grads = ring_backward(dout, q, k, v, out.to(q.dtype), lse, None, spec, plan)
    ref_out, ref_lse = MATH.forward(q, k, v, True, 0.25)
    assert rel_err(out, ref_out) < 1e-6 and rel_err(lse.transpose(1, 2), ref_lse) < 1e-6
    for got, ref in zip(grads, MATH.backward(BackwardRows(dout, q, None, None), k, v, True, 0.25), strict=True):
        assert rel_err(got, ref) < 1e-5


@pytest.fixture
def fresh_selection(monkeypatch):
    """Selection caches cleared before and after; FA3 and cuDNN absent, the GPU an sm80 where every trial call
    passes, unless a test says otherwise."""
    def clear() -> None:
        for cached in (kernels.select_kernel, kernels._import_flash_attn, kernels._import_fa3, kernels._warn_once):
            cached.cache_clear()
        kernels._TRIALS.clear()
        kernels._CHOSEN.clear()

    clear()
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (8, 0))
    monkeypatch.setattr(kernels, "_cudnn_unavailable", lambda: "torch was built without cuDNN")
    monkeypatch.setattr(kernels, "_trial", lambda kernel, device, dtype, head_dim: None)
    yield monkeypatch
    clear()


def _install(monkeypatch, name: str, module: types.ModuleType) -> None:
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    monkeypatch.setitem(sys.modules, name, module)


def test_flash_attn_is_chosen_on_cuda_when_it_imports(fresh_selection) -> None:
    package = types.ModuleType("flash_attn")
    package.__version__ = "2.8.3"
    _install(fresh_selection, "flash_attn", package)
    _install(fresh_selection, "flash_attn.flash_attn_interface", standins.flash_attn_interface("2.8.3"))
    cuda = torch.device("cuda", 0)
    assert kernels.select_kernel(cuda, torch.bfloat16, 64).name == "flash_attn 2.8.3"
    assert kernels.select_kernel(cuda, torch.float32, 64).name == "torch efficient"  # flash-attn is fp16/bf16 only
    assert kernels.select_kernel(cuda, torch.bfloat16, 320).name == "torch efficient"  # head_dim > 256
    fresh_selection.setattr(kernels, "cuda_capability", lambda device: (9, 0))
    _install(fresh_selection, "flash_attn_interface", fa3_standins.fa3_interface("custom_op"))
    kernels._import_fa3.cache_clear()  # "not installed" was remembered above
    assert kernels.select_kernel(torch.device("cuda", 1), torch.float16, 128).name == "fa3"


def test_flash_attn_that_fails_to_import_falls_back_with_one_warning(fresh_selection, tmp_path) -> None:
    broken = tmp_path / "flash_attn"
    broken.mkdir()
    (broken / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (broken / "flash_attn_interface.py").write_text(
        'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")\n')
    fresh_selection.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("flash_attn")]:
        fresh_selection.delitem(sys.modules, name)
    with pytest.warns(RuntimeWarning, match="flash_attn.flash_attn_interface failed to import.*undefined symbol"):
        kernel = kernels.select_kernel(torch.device("cuda", 0), torch.bfloat16, 64)
    assert kernel.name == "torch cuda flash"
    with pytest.raises(kernels.KernelUnavailable, match="backend 'flash_attn': .*undefined symbol"):
        kernels.select_kernel(torch.device("cuda", 0), torch.bfloat16, 64, "flash_attn")


def _check_varlen(kernel) -> None:
    """Packed segments (causal bottom-right rectangles and full ones, GQA) against the float64 kernel."""
    gen = torch.Generator().manual_seed(5)
    for causal, rows, keys in ((True, [5, 3, 8], [9, 3, 12]), (False, [4, 7], [6, 2])):
        q, dout = (torch.randn(sum(rows), 4, 16, generator=gen) for _ in range(2))
        k, v = (torch.randn(sum(keys), 2, 16, generator=gen) for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (rows, keys))
        args = (VarlenSegments(cu_q, cu_k, max(rows), max(keys)), causal, 0.25)
        out, lse = kernel.varlen_forward(q, k, v, *args)
        ref_out, ref_lse = MATH.varlen_forward(q, k, v, *args)
        assert out.shape == q.shape and lse.shape == (4, sum(rows))
        assert rel_err(out, ref_out) < 1e-6 and rel_err(lse, ref_lse) < 1e-6
        grads = kernel.varlen_backward(BackwardRows(dout, q, out, lse), k, v, *args)
        refs = MATH.varlen_backward(BackwardRows(dout, q, ref_out, ref_lse), k, v, *args)
        for got, ref in zip(grads, refs, strict=True):
            assert got.shape == ref.shape and rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("version", VARLEN_VERSIONS)
def test_flash_attn_varlen_calls_bind_and_unpack(version: str) -> None:
    """The varlen forms: block_table from 2.5.7, the padded per-sequence lse of 2.5.x, custom ops from 2.7."""
    kernel = FlashAttn2.load(standins.flash_attn_interface(version), version, deterministic=True)
    standins.CALLS.clear()
    _check_varlen(kernel)
    assert any(c["fn"] == "varlen_bwd" and c["deterministic"] for c in standins.CALLS)


@pytest.mark.parametrize("form", ["custom_op", "plain"])
def test_fa3_flash_attn_interface_varlen_calls_bind_and_unpack(form: str) -> None:
    _check_varlen(FlashAttn3.load(fa3_standins.fa3_interface(form)))
