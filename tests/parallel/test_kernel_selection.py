"""Kernel choice by device and dtype, head_dim checks, trials (the CUDA ops' call forms: test_kernel_op_schemas.py).

No GPU is needed: the fixture replaces the CUDA trial call (the tests here say what it does).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch

from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.select import KernelUnavailable, select_kernel
from tests import fa3_standins
from tests import flash_attn_standins as standins

CUDA = torch.device("cuda", 0)


def _clear(imports: bool = True) -> None:
    for cached in (kernels.select_kernel, kernels._warn_once) + ((kernels._import_flash_attn, kernels._import_fa3)
                                                                  if imports else ()):
        cached.cache_clear()
    kernels._TRIALS.clear()
    kernels._RAGGED.clear()
    kernels._CHOSEN.clear()


@pytest.fixture(autouse=True)
def no_packages(monkeypatch):
    """As on a machine without flash-attn, FA3 or cuDNN, with an sm80 GPU where every trial call passes;
    caches cleared around each test."""
    _clear()
    monkeypatch.setattr(kernels, "_import_flash_attn", lambda: "flash_attn is not installed")
    monkeypatch.setattr(kernels, "_import_fa3", lambda: "flash_attn_interface is not installed")
    monkeypatch.setattr(kernels, "_cudnn_unavailable", lambda: "torch 2.x was built without cuDNN")
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (8, 0))
    monkeypatch.setattr(kernels, "_trial", lambda kernel, device, dtype, head_dim: None)
    monkeypatch.setattr(kernels, "_gqa_probe", lambda kernel, native, device, dtype, head_dim: False)
    yield
    _clear(imports=False)  # the import functions are still the stand-ins here


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
    ("cuda", torch.bfloat16, 64, "cudnn", r"backend 'cudnn': torch 2.x was built without cuDNN; use backend"),
    ("cpu", torch.bfloat16, 64, "cudnn", r"backend 'cudnn' needs CUDA tensors"),
    ("cuda", torch.float32, 64, "cudnn", r"takes float16/bfloat16 on CUDA, got torch.float32"),
    ("cuda", torch.bfloat16, 64, "xformers", r"unknown attention backend 'xformers'; choose one of fa3, cudnn"),
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


def _with_packages(monkeypatch, fa3: bool, flash_attn: bool, cudnn: bool, capability: tuple[int, int]) -> None:
    if fa3:
        monkeypatch.setattr(kernels, "_import_fa3", lambda: fa3_standins.fa3_interface("plain"))
    if flash_attn:
        monkeypatch.setattr(kernels, "_import_flash_attn", lambda: (standins.flash_attn_interface("2.8.3"), "2.8.3"))
    if cudnn:
        monkeypatch.setattr(kernels, "_cudnn_unavailable", lambda: None)
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: capability)


@pytest.mark.parametrize("capability,fa3,flash_attn,cudnn,half,fp32", [
    ((9, 0), True, True, True, "fa3", "torch efficient"),
    ((9, 0), False, True, True, "cudnn", "torch efficient"),
    ((9, 0), False, False, True, "cudnn", "torch efficient"),
    ((9, 0), True, True, False, "fa3", "torch efficient"),
    ((9, 0), False, True, False, "flash_attn 2.8.3", "torch efficient"),
    ((8, 0), True, True, True, "cudnn", "torch efficient"),  # FA3 is Hopper only
    ((8, 0), True, True, False, "flash_attn 2.8.3", "torch efficient"),
    ((8, 0), False, False, False, "torch cuda flash", "torch efficient"),
    ((7, 5), False, False, True, "torch cuda flash", "torch efficient"),  # cuDNN attention needs sm80
])
def test_automatic_order_on_cuda(monkeypatch, capability, fa3, flash_attn, cudnn, half, fp32) -> None:
    """fa3 (sm90) -> cudnn -> flash_attn -> torch flash -> torch_efficient; fp32 goes to efficient; CPU as ever."""
    _with_packages(monkeypatch, fa3, flash_attn, cudnn, capability)
    for dtype in (torch.float16, torch.bfloat16):
        assert select_kernel(CUDA, dtype, 64).name == half
    assert select_kernel(CUDA, torch.float32, 64).name == fp32
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert select_kernel(torch.device("cpu"), dtype, 64).name == "torch cpu flash"


def test_cudnn_limits_go_to_the_next_backend(monkeypatch) -> None:
    _with_packages(monkeypatch, False, False, True, (9, 0))
    assert select_kernel(CUDA, torch.bfloat16, 256).name == "torch cuda flash"  # cuDNN: head_dim up to 128
    assert select_kernel(CUDA, torch.bfloat16, 64, None, True).name == "torch cuda flash"  # not deterministic
    with pytest.raises(KernelUnavailable, match="'cudnn' has no deterministic backward"):
        select_kernel(CUDA, torch.bfloat16, 64, "cudnn", True)


def test_a_backend_whose_trial_fails_is_skipped_with_one_warning(monkeypatch) -> None:
    """flash-attn imports but has no kernels for this GPU: the next backend runs, one warning names the error."""
    _with_packages(monkeypatch, False, True, False, (10, 0))
    trials = []

    def trial(kernel, device, dtype, head_dim) -> None:
        trials.append((kernel.name, device, dtype, head_dim))
        if kernel.name.startswith("flash_attn"):
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    monkeypatch.setattr(kernels, "_trial", trial)
    with pytest.warns(RuntimeWarning) as caught:
        assert select_kernel(CUDA, torch.bfloat16, 64).name == "torch cuda flash"
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "backend 'flash_attn' failed its trial call on cuda:0 with torch.bfloat16 and head_dim 64 (RuntimeError: "
        "CUDA error: no kernel image is available for execution on the device); choose another backend or leave it "
        "unset; using the next attention backend")
    assert trials == [("flash_attn 2.8.3", CUDA, torch.bfloat16, 64), ("torch cuda flash", CUDA, torch.bfloat16, 64)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second trial of either backend
        assert select_kernel(CUDA, torch.bfloat16, 64, None, True).name == "torch cuda flash"
        with pytest.raises(KernelUnavailable, match=r"backend 'flash_attn' failed its trial call .*no kernel image"):
            select_kernel(CUDA, torch.bfloat16, 64, "flash_attn")
    assert len(trials) == 2
    with pytest.warns(RuntimeWarning, match="head_dim 128"):
        select_kernel(CUDA, torch.bfloat16, 128)  # another head_dim is another trial
    assert len(trials) == 4
    assert kernels.chosen_backends() == ("torch cuda flash",)


def test_trials_run_on_cuda_only_and_are_cached(monkeypatch) -> None:
    _with_packages(monkeypatch, False, False, True, (9, 0))
    trials = []
    monkeypatch.setattr(kernels, "_trial", lambda kernel, *key: trials.append((kernel.name, *key)))
    assert select_kernel(CUDA, torch.bfloat16, 64).name == "cudnn"  # admitted
    assert select_kernel(CUDA, torch.bfloat16, 64, "cudnn").name == "cudnn"
    select_kernel(CUDA, torch.float32, 64)
    select_kernel(CUDA, torch.float64, 64)  # math needs no trial
    select_kernel(torch.device("cpu"), torch.float32, 64)  # nor does the CPU
    assert trials == [("cudnn", CUDA, torch.bfloat16, 64), ("torch efficient", CUDA, torch.float32, 64)]
    assert kernels.chosen_backends() == ("cudnn", "torch efficient", "math", "torch cpu flash")


def test_the_real_trial_call_runs_the_kernel(monkeypatch) -> None:
    """The trial itself (here on the CPU kernels): it calls the kernel's four entry points and raises their errors."""
    from cp_train.parallel.kernels.trial import trial_call

    cpu = torch.device("cpu")
    trial_call(kernels.MathKernel(), cpu, torch.float32, 16)
    trial_call(select_kernel(cpu, torch.bfloat16, 16), cpu, torch.bfloat16, 16)

    class Broken(kernels.MathKernel):
        def varlen_backward(self, *args):
            raise RuntimeError("no varlen kernel")

    with pytest.raises(RuntimeError, match="no varlen kernel"):
        trial_call(Broken(), cpu, torch.float32, 16)

    class NonFinite(kernels.MathKernel):
        def forward(self, q, k, v, causal, scale):
            out, lse = super().forward(q, k, v, causal, scale)
            return out * float("nan"), lse

    with pytest.raises(RuntimeError, match="non-finite"):
        trial_call(NonFinite(), cpu, torch.float32, 16)


@pytest.mark.parametrize("agrees", [True, False])
def test_cudnn_takes_gqa_as_it_is_where_the_probe_agrees(monkeypatch, agrees: bool) -> None:
    """cuDNN is handed fewer K/V heads without the expanding copy only where this build gives the expanded
    call's results (the probe compares them on the device)."""
    _with_packages(monkeypatch, False, False, True, (9, 0))
    probed = []

    def probe(kernel, native, device, dtype, head_dim):  # noqa: ANN001
        probed.append((kernel.native_gqa, native.native_gqa, head_dim))
        return agrees

    monkeypatch.setattr(kernels, "_gqa_probe", probe)
    kernel = select_kernel(CUDA, torch.bfloat16, 64)
    assert kernel.name == "cudnn" and kernel.native_gqa is agrees and probed == [(False, True, 64)]
    assert kernel.native_varlen  # packed documents go to its varlen kernel


@pytest.mark.parametrize("capability,fa3,flash_attn,varlen", [
    ((9, 0), True, True, "fa3"), ((9, 0), False, True, "flash_attn"), ((8, 0), True, True, "flash_attn"),
    ((9, 0), False, False, "torch cuda flash")])
def test_cudnn_runs_packed_documents_on_the_fastest_varlen_kernel(monkeypatch, capability, fa3, flash_attn,
                                                                   varlen) -> None:
    """cuDNN named (FA3 would be chosen first otherwise): its varlen calls go to FA3 on Hopper where installed,
    else to flash-attn 2, else to PyTorch's flash."""
    _with_packages(monkeypatch, fa3, flash_attn, True, capability)
    kernel = select_kernel(CUDA, torch.bfloat16, 64, "cudnn")
    assert kernel.name == "cudnn" and kernel.varlen_kernel.name.startswith(varlen)


def test_cudnn_ragged_is_chosen_by_name_after_its_own_trial(monkeypatch) -> None:
    """``cudnn_ragged``: never in the automatic order; by name, PyTorch's switch set before its trial, which
    decides it (and its lse layout) once; the kernel runs packed documents as dense calls (no varlen entry); a
    failed trial is one error that names the backend to use instead; on the CPU it says it needs CUDA."""
    _with_packages(monkeypatch, False, False, True, (9, 0))
    monkeypatch.delenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", raising=False)
    trials = []

    def trial(kernel, device, dtype, head_dim):  # noqa: ANN001, ANN202
        trials.append(os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"))
        return dataclasses.replace(kernel, name="cudnn_ragged", ragged_graphs=True, lse_rows_major=True)

    monkeypatch.setattr(kernels, "_ragged_trial", trial)
    assert select_kernel(CUDA, torch.bfloat16, 64).name == "cudnn"
    varlen_trials = []
    monkeypatch.setattr(kernels, "_trial", lambda kernel, *key: varlen_trials.append(kernel.name))
    kernel = select_kernel(CUDA, torch.bfloat16, 64, "cudnn_ragged")
    assert kernel.name == "cudnn_ragged" and not kernel.native_varlen and kernel.lse_rows_major
    assert kernel.varlen_rectangles and varlen_trials == [kernel.varlen_kernel.name]  # its full pieces' kernel
    select_kernel.cache_clear()
    select_kernel(CUDA, torch.bfloat16, 64, "cudnn_ragged")
    assert trials == ["1"]
    _clear(imports=False)
    monkeypatch.setattr(kernels, "_ragged_trial", lambda *args: (_ for _ in ()).throw(RuntimeError("built a graph")))
    with pytest.raises(KernelUnavailable, match="'cudnn_ragged' failed its trial.*built a graph.*use backend 'cudnn'"):
        select_kernel(CUDA, torch.bfloat16, 64, "cudnn_ragged")
    with pytest.raises(KernelUnavailable, match="'cudnn_ragged' needs CUDA tensors"):
        select_kernel(torch.device("cpu"), torch.bfloat16, 64, "cudnn_ragged")
    with pytest.raises(KernelUnavailable, match="'cudnn_ragged' has no deterministic backward"):
        select_kernel(CUDA, torch.bfloat16, 64, "cudnn_ragged", True)
