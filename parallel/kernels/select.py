"""Attention kernels that return the log-sum-exp, chosen once per (device, dtype, head_dim, backend).

Every kernel object ``select_kernel`` returns follows the contract of ``contract.py`` (``AttentionKernel``:
dense and varlen forward and backward calls, their shapes and masks).

Backends (``backend=None`` picks the first that fits, in this order):

=============== ======================================================= ===================
name            kernel                                                  device / dtypes
=============== ======================================================= ===================
fa3             FA3 (``flash_attn_interface``, Hopper build)            sm90, fp16/bf16
cudnn           cuDNN SDPA (``cudnn.py``, PyTorch's cuDNN attention ops) sm80+, fp16/bf16
cudnn_ragged    cuDNN SDPA, documents as dense calls (``cudnn_ragged.py``) sm80+, fp16/bf16 (by name only)
flash_attn      flash-attn 2.5-2.8 (``flash_attn.py``)                  CUDA, fp16/bf16
torch           PyTorch's flash kernels (CPU: any float; CUDA: fp16/bf16) CPU, CUDA
torch_efficient PyTorch's memory-efficient kernels (the CUDA fp32 path)  CUDA, fp16/bf16/fp32
math            float64 reference, materialises the scores (tests)       any
=============== ======================================================= ===================

CPU always runs ``torch``; CUDA float64 has no fused kernel: it runs on ``math``. The flash-attn
packages are imported when a backend is first chosen; an install that fails to import (a wheel built
against another torch raises "undefined symbol") is skipped with one warning naming the error.
Importing is not enough on CUDA: every fused backend is admitted only after a trial call (a tiny causal forward
and backward, GQA, on the device, its results checked against ``math``'s; once per (device, dtype, head_dim,
backend)). In the automatic order a failed trial (a wheel without kernels for this GPU, a cuDNN build without this
shape) skips the backend with one warning naming it and the error; a backend asked for by name that fails its
trial raises ``KernelUnavailable``. ``chosen_backends()`` names the kernels chosen so far.
``deterministic=True`` reaches flash-attn's and FA3's backward, turns the efficient kernel's key
splitting off, runs PyTorch's CUDA flash backward under ``torch.use_deterministic_algorithms``, and
rules cuDNN out (its backward is not deterministic); the CPU and math kernels are deterministic anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import warnings

import torch

from cp_train.parallel.kernels import cudnn, cudnn_ragged
from cp_train.parallel.kernels.backends import BACKENDS
from cp_train.parallel.kernels.contract import AttentionKernel, BackwardRows, OutLse, QKVGrads
from cp_train.parallel.kernels.flash_attn import FlashAttn2, FlashAttn3
from cp_train.parallel.kernels.reference import MathKernel, _math_scores  # noqa: F401 - _math_scores: the tests' path
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash, TorchCudaFlash, TorchEfficient
from cp_train.parallel.kernels.trial import native_gqa_agrees, trial_call

HALF = (torch.float16, torch.bfloat16)
TrialKey = tuple[torch.device, torch.dtype, int, str]  # (device, dtype, head_dim, backend)
_TRIALS: dict[TrialKey, str | None] = {}  # each trial call's outcome: None (passed) or the error, one line
_CHOSEN: dict[str, None] = {}  # the names of the kernels select_kernel returned, in order (a set)
_RAGGED: dict[TrialKey, AttentionKernel | str] = {}  # cudnn_ragged's trial: the admitted kernel, or the error
_trial = trial_call  # the admission trial (tests replace it)
_gqa_probe = native_gqa_agrees  # whether cuDNN takes GQA as it is (tests replace it)
_ragged_trial = cudnn_ragged.trial  # cudnn_ragged's admission (tests replace it)


class KernelUnavailable(ValueError):
    """A backend cannot run this (device, dtype, head_dim); the message says what to change."""


def _import(module: str) -> object | str:
    """The imported ``module``, or why it cannot be used ("not installed" / "failed to import: ...")."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module} is not installed"
    try:
        return importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - a broken build fails in many ways (ImportError, OSError, ...)
        return f"{module} failed to import ({type(error).__name__}: {error})"


@functools.cache
def _import_flash_attn() -> tuple[object, str] | str:
    """(``flash_attn.flash_attn_interface``, ``flash_attn.__version__``), or why it cannot be used."""
    interface = _import("flash_attn.flash_attn_interface")
    if isinstance(interface, str):
        return interface
    return interface, str(importlib.import_module("flash_attn").__version__)


@functools.cache
def _import_fa3() -> object | str:
    """FA3's ``flash_attn_interface`` module, or why it cannot be used."""
    return _import("flash_attn_interface")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _check_flash_head_dim(name: str, head_dim: int) -> None:
    if head_dim % 8 or head_dim > 256:
        raise KernelUnavailable(f"{name} needs head_dim a multiple of 8 and at most 256, got {head_dim}: "
                                f"change hidden_size / num_heads, or use backend 'torch_efficient' or 'math'")


def _build(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
           deterministic: bool) -> AttentionKernel:
    """The kernel ``backend`` gives for (device, dtype, head_dim); KernelUnavailable saying why not."""
    cuda = device.type == "cuda"
    if backend == "math":
        return MathKernel()
    if backend in ("fa3", "cudnn", "cudnn_ragged", "flash_attn", "torch_efficient") and not cuda:
        raise KernelUnavailable(f"backend {backend!r} needs CUDA tensors, got {device.type}; use backend 'torch'")
    if backend in ("fa3", "cudnn", "cudnn_ragged", "flash_attn") or (backend == "torch" and cuda):
        if dtype not in HALF:
            raise KernelUnavailable(f"backend {backend!r} takes float16/bfloat16 on CUDA, got {dtype}: use "
                                    f"backend 'torch_efficient' (float32) or 'math' (float64), or bf16 autocast")
        _check_flash_head_dim(f"backend {backend!r}", head_dim)
    if backend == "torch":
        return TorchCudaFlash(deterministic) if cuda else TorchCpuFlash()
    if backend == "torch_efficient":
        if dtype not in (*HALF, torch.float32):
            raise KernelUnavailable(f"backend 'torch_efficient' takes float16/bfloat16/float32, got {dtype}; "
                                    f"use backend 'math' for float64")
        if head_dim % 4:
            raise KernelUnavailable(f"backend 'torch_efficient' needs head_dim a multiple of 4, got {head_dim}")
        return TorchEfficient(deterministic)
    if backend == "cudnn":
        return _build_cudnn(device, head_dim, deterministic)
    if backend == "cudnn_ragged":
        kernel = _build_cudnn(device, head_dim, deterministic, backend)
        cudnn_ragged.enable()  # before the trial: PyTorch reads the switch at the process's first cuDNN call
        return kernel
    if backend == "flash_attn":
        found = _import_flash_attn()
        if isinstance(found, str):
            raise KernelUnavailable(f"backend 'flash_attn': {found}; install cp-train[gpu] or use backend 'torch'")
        interface, version = found
        try:
            return FlashAttn2.load(interface, version, deterministic)
        except ValueError as error:
            raise KernelUnavailable(str(error)) from None
    if backend == "fa3":
        found = _import_fa3()
        if isinstance(found, str):
            raise KernelUnavailable(f"backend 'fa3': {found}")
        major, minor = cuda_capability(device)
        if major != 9:
            raise KernelUnavailable(f"backend 'fa3' runs on Hopper (sm90) GPUs only, this one is sm{major}{minor}; "
                                    f"use backend 'flash_attn'")
        try:
            return FlashAttn3.load(found, deterministic)
        except ValueError as error:
            raise KernelUnavailable(str(error)) from None
    raise KernelUnavailable(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _build_cudnn(device: torch.device, head_dim: int, deterministic: bool, name: str = "cudnn") -> AttentionKernel:
    """The cuDNN kernel (dtype already checked) for backend ``name``; KernelUnavailable saying why not."""
    why = _cudnn_unavailable()
    if why is not None:
        raise KernelUnavailable(f"backend {name!r}: {why}; use backend 'flash_attn' or 'torch'")
    major, minor = cuda_capability(device)
    if major < 8:
        raise KernelUnavailable(f"backend {name!r} needs an sm80 or newer GPU, this one is sm{major}{minor}; "
                                f"use backend 'torch'")
    if head_dim > cudnn.MAX_HEAD_DIM:
        raise KernelUnavailable(f"backend {name!r} takes head_dim up to {cudnn.MAX_HEAD_DIM}, got {head_dim}; "
                                f"use backend 'flash_attn' or 'torch'")
    if deterministic:
        raise KernelUnavailable(f"backend {name!r} has no deterministic backward; use backend 'fa3', 'flash_attn' "
                                "or 'torch', or turn deterministic off")
    return cudnn.CudnnAttention(varlen_kernel=_varlen_for_cudnn(device, head_dim, deterministic))


def _varlen_for_cudnn(device: torch.device, head_dim: int, deterministic: bool) -> AttentionKernel:
    """The varlen kernel behind cuDNN (packed documents' steps): FA3 (sm90) where installed, else flash-attn 2,
    else PyTorch's flash (the cuDNN trial call runs its varlen calls too)."""
    for backend in ("fa3", "flash_attn"):
        try:
            return _build(backend, device, torch.bfloat16, head_dim, deterministic)
        except KernelUnavailable:
            continue
    return TorchCudaFlash(deterministic)


def _cudnn_unavailable() -> str | None:
    """Why this torch cannot run cuDNN attention, or None (tests replace it)."""
    return cudnn.cudnn_unavailable()


def _automatic_order(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if device.type != "cuda":
        return ("torch",)
    if dtype in HALF:
        return ("fa3", "cudnn", "flash_attn", "torch", "torch_efficient")
    return ("torch_efficient",) if dtype == torch.float32 else ("math",)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _admit(backend: str, kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """KernelUnavailable unless ``kernel`` passes its trial call on this CUDA device (once per
    (device, dtype, head_dim, backend); CPU kernels and ``math`` need none)."""
    if device.type != "cuda" or backend == "math":
        return
    key = (device, dtype, head_dim, backend)
    if key not in _TRIALS:
        try:
            _trial(kernel, device, dtype, head_dim)
            _TRIALS[key] = None
        except Exception as error:  # noqa: BLE001 - any failure (missing kernels, cuDNN refusals) means "not here"
            _TRIALS[key] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    if _TRIALS[key] is not None:
        raise KernelUnavailable(f"backend {backend!r} failed its trial call on {device} with {dtype} and head_dim "
                                f"{head_dim} ({_TRIALS[key]}); choose another backend or leave it unset")


def _admitted(backend: str, kernel: AttentionKernel, device: torch.device, dtype: torch.dtype,
              head_dim: int) -> AttentionKernel:
    """``kernel`` once it passes its trial (``_admit``; ``cudnn_ragged`` its own too, ``_ragged``); on CUDA, cuDNN
    with GQA handed to the op as it is where the probe finds this build takes it (no K/V copy per call)."""
    if backend == "cudnn_ragged" and device.type == "cuda":
        kernel = _ragged(kernel, device, dtype, head_dim)  # a trial of its own: dense calls only
    else:
        _admit(backend, kernel, device, dtype, head_dim)
    if backend in ("cudnn", "cudnn_ragged") and device.type == "cuda":
        native = dataclasses.replace(kernel, native_gqa=True)
        if _gqa_probe(kernel, native, device, dtype, head_dim):
            return native
    return kernel


def _ragged(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernel:
    """The cuDNN kernel with ragged graphs once ``cudnn_ragged.trial`` passes (once per key), else
    KernelUnavailable naming what failed."""
    key = (device, dtype, head_dim, "cudnn_ragged")
    if key not in _RAGGED:
        try:
            _RAGGED[key] = _ragged_trial(kernel, device, dtype, head_dim)
        except Exception as error:  # noqa: BLE001 - a refusal, a mismatch or a graph per length: "not here"
            _RAGGED[key] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    found = _RAGGED[key]
    if isinstance(found, str):
        raise KernelUnavailable(f"backend 'cudnn_ragged' failed its trial on {device} with {dtype} and head_dim "
                                f"{head_dim} ({found}); use backend 'cudnn' (documents on varlen calls)")
    if found.varlen_kernel is not None:  # the documents' full pieces above cp 1 (``varlen_rectangles``) run on it
        _admit(f"cudnn_ragged's varlen kernel ({found.varlen_kernel.name})", found.varlen_kernel, device, dtype,
               head_dim)
    return found


def chosen_backends() -> tuple[str, ...]:
    """The names of the kernels ``select_kernel`` has chosen in this process, in the order first chosen
    (e.g. ``("cudnn", "torch efficient")``): for the run's setup record."""
    return tuple(_CHOSEN)


@functools.cache
def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None = None,
                  deterministic: bool = False) -> AttentionKernel:
    """The kernel for q/k/v of ``dtype`` on ``device`` with ``head_dim`` (cached: decided once).

    ``backend`` None picks the first backend of the table above that can run it and, on CUDA, passes its
    trial call; a package that is installed but cannot be used, or a backend whose trial fails, is skipped
    with one warning. A named ``backend`` that cannot run raises ``KernelUnavailable`` saying what to change.
    """
    device = torch.device(device)
    if backend is not None:
        kernel = _admitted(backend, _build(backend, device, dtype, head_dim, deterministic), device, dtype, head_dim)
        _CHOSEN[kernel.name] = None
        return kernel
    reasons = []
    for candidate in _automatic_order(device, dtype):
        try:
            kernel = _admitted(candidate, _build(candidate, device, dtype, head_dim, deterministic), device, dtype,
                               head_dim)
        except KernelUnavailable as error:
            reasons.append(str(error))
            if "failed to import" in str(error) or "failed its trial call" in str(error):
                _warn_once(f"{error}; using the next attention backend")
            continue
        _CHOSEN[kernel.name] = None
        return kernel
    raise KernelUnavailable(f"no attention kernel runs {dtype} with head_dim {head_dim} on {device}: "
                            + "; ".join(reasons))


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  softmax_scale: float | None = None, backend: str | None = None) -> OutLse:
    """One call of the selected kernel: out [B, Sq, H, D] (q's dtype; float64 for math), lse [B, H, Sq]."""
    kernel = select_kernel(q.device, q.dtype, q.shape[-1], backend)
    return kernel.forward(q, k, v, causal, _scale(q, softmax_scale))


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool = False, softmax_scale: float | None = None,
                   backend: str | None = None) -> QKVGrads:
    """Gradients (dq [B, Sq, H, D], dk, dv [B, Sk, Hk, D]) of one K/V block, given the rows' final out/lse."""
    kernel = select_kernel(q.device, q.dtype, q.shape[-1], backend)
    return kernel.backward(BackwardRows(dout, q, out, lse), k, v, causal, _scale(q, softmax_scale))
