"""The flash-attn packages' private forward/backward functions, bound once per installed version.

The varlen functions (``_flash_attn_varlen_forward``/``_backward``) follow the same forms; besides,
the forward requires a ``block_table`` argument in 2.5.7-2.6.0.post1 (2.5.0-2.5.6 have none; 2.6.1 gave
it a default; None is passed wherever it exists), and 2.5.x keep the varlen lse padded per sequence
(``[sequences, H, max_seqlen]``) where 2.6 and later pack it (``[H, total]``).

The ring needs each block's log-sum-exp and a backward that takes the rows' *final* ``out``/``lse``,
which only the packages' private functions offer. Their signatures changed between releases
(read from the sources at each tag):

========  ==========================================================  ==================
version   window / softcap arguments                                   forward returns
========  ==========================================================  ==================
2.5.x     ``window_size=(l, r)``                                       8 values, lse at 5
2.6.x     ``window_size=(l, r)``, ``softcap`` before ``alibi_slopes``  8 values, lse at 5
2.7, 2.8  ``window_size_left``, ``window_size_right``, ``softcap``      4 values, lse at 1
========  ==========================================================  ==================

From 2.7 the functions are ``torch.library.custom_op`` objects whose Python signature reads
``(*args, **kwargs)``, so the form is chosen from ``flash_attn.__version__`` (never from
``inspect.signature``) and every call passes keywords. FA3 (the ``flash_attn_interface`` module of
the Hopper build) carries no version; its argument names are read once from the function or its
custom-op schema (``causal``/``is_causal``, ``window_size``/``window_size_left``) and the calls
are built from them, passing None for the arguments it requires that the ring does not use.

Both take ``[B, S, H, D]`` fp16/bf16 tensors, GQA natively, and return lse ``[B, H, S]`` fp32;
both backwards want a dense lse and write into preallocated dq, dk, dv. Their dense causal mask is
aligned bottom-right: dense causal calls must be square (``check_square_causal``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch

from cp_train.parallel.kernels.contract import BackwardRows, OutLse, QKVGrads, VarlenSegments, check_square_causal
from cp_train.parallel.kernels.varlen import lse_from_padded, lse_to_padded

MIN_FLASH_ATTN = (2, 5)


def parse_version(version: str) -> tuple[int, int]:
    """``"2.7.4.post1"`` -> ``(2, 7)``; ValueError naming the string when it is not a version."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"cannot read flash-attn version {version!r}") from None


def _patch(version: str) -> int:
    digits = "".join(c for c in (version.split(".") + ["0"])[2] if c.isdigit())
    return int(digits or 0)


def flash_attn_call_form(version: str) -> str:
    """The call form of flash-attn ``version``: ``"2.5"``, ``"2.6"`` or ``"2.7"`` (2.7 and later)."""
    major_minor = parse_version(version)
    if major_minor < MIN_FLASH_ATTN:
        raise ValueError(f"flash-attn {version} is too old: cp-train needs flash-attn >= 2.5 "
                         f"(pip install 'flash-attn>=2.5')")
    if major_minor >= (2, 7):
        return "2.7"
    return "2.6" if major_minor == (2, 6) else "2.5"


def parameter_names(fn: Callable[..., Any]) -> dict[str, bool]:
    """``{name: has_default}`` of ``fn``'s arguments, read from its custom-op schema when it has one."""
    op = getattr(fn, "_opoverload", None)
    if op is not None:
        return {arg.name: arg.has_default_value() for arg in op._schema.arguments}
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default is not inspect.Parameter.empty for p in params
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def _window(names: dict[str, bool] | str, window: tuple[int, int] = (-1, -1)) -> dict[str, Any]:
    """flash-attn's ``window`` ``(left, right)`` (-1: unbounded; default none) in the form the function takes (a
    call form or its argument names): a tuple ``window_size`` (2.5, 2.6, early FA3) or two ints (2.7+, FA3)."""
    if "window_size_left" in names or names == "2.7":
        return {"window_size_left": window[0], "window_size_right": window[1]}
    return {"window_size": tuple(window)}


def with_window(options: dict[str, Any], window: tuple[int, int] | None) -> dict[str, Any]:
    """``options`` (a call's fixed keywords, no window) with flash-attn's ``window`` in their form; the same
    dict without one. ``window`` comes from ``window_plan.flash_window``: its left is >= 0 or -1 (unbounded),
    never a computed negative (flash-attn reads any negative as unbounded)."""
    if window is None:
        return options
    return {**options, **_window(options, window)}


@dataclass(frozen=True)
class FlashAttn2:
    """flash-attn 2.5-2.8 with the kernel contract (``contract.py``); built by ``load``.

    ``options`` are the keyword arguments both calls share for the version (no dropout, no window,
    no ALiBi, no softcap where it exists); ``lse_index`` is where the forward returns the lse.
    """

    name: str
    fwd: Callable[..., Any]
    bwd: Callable[..., Any]
    varlen_fwd: Callable[..., Any] | None
    varlen_bwd: Callable[..., Any] | None
    options: dict[str, Any]
    varlen_options: dict[str, Any]
    lse_index: int
    padded_varlen_lse: bool
    deterministic: bool = False

    @classmethod
    def load(cls, interface: ModuleType, version: str, deterministic: bool = False) -> FlashAttn2:
        """Bind ``interface`` (``flash_attn.flash_attn_interface``) of flash-attn ``version``."""
        form = flash_attn_call_form(version)
        options = {"dropout_p": 0.0, **_window(form), "alibi_slopes": None}
        if form != "2.5":
            options["softcap"] = 0.0
        takes_block_table = form != "2.5" or _patch(version) >= 7  # required in 2.5.7-2.6.0.post1
        varlen_options = {**options, "block_table": None} if takes_block_table else options
        return cls(f"flash_attn {version}", interface._flash_attn_forward, interface._flash_attn_backward,
                   getattr(interface, "_flash_attn_varlen_forward", None),
                   getattr(interface, "_flash_attn_varlen_backward", None), options, varlen_options,
                   1 if form == "2.7" else 5, form == "2.5", deterministic)

    native_window = True  # dense calls take flash-attn's window_size (``window=``)
    native_varlen = True  # flash_attn_varlen_func's kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                window: tuple[int, int] | None = None) -> OutLse:
        check_square_causal(self.name, q, k, causal)
        result = self.fwd(q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_softmax=False,
                          **with_window(self.options, window))
        return result[0], result[self.lse_index]

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float, window: tuple[int, int] | None = None) -> QKVGrads:
        check_square_causal(self.name, rows.q, k, causal)
        dout, q, out, lse = rows
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.bwd(dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
                 softmax_scale=scale, causal=causal, deterministic=self.deterministic, rng_state=None,
                 **with_window(self.options, window))
        return dq, dk, dv

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse:
        cu_q, cu_k, max_q, max_k = segments
        result = self.varlen_fwd(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, softmax_scale=scale, causal=causal, return_softmax=False,
                                 **self.varlen_options)
        lse = result[self.lse_index]
        return result[0], lse_from_padded(lse, cu_q, q.shape[0]) if self.padded_varlen_lse else lse

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads:
        dout, q, out, lse = rows
        cu_q, cu_k, max_q, max_k = segments
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse = lse_to_padded(lse, cu_q, max_q) if self.padded_varlen_lse else lse.contiguous()
        self.varlen_bwd(dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                        softmax_scale=scale, causal=causal, deterministic=self.deterministic, rng_state=None,
                        **self.options)
        return dq, dk, dv


def _fixed_arguments(names: dict[str, bool], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (those ``names`` has) plus None for every required argument the ring does not use."""
    fixed = {name: None for name, has_default in names.items() if not has_default}
    fixed.update({name: value for name, value in given.items() if name in names})
    return fixed


@dataclass(frozen=True)
class FlashAttn3:
    """FA3 (``flash_attn_interface``, Hopper) with the same contract; built by ``load``.

    ``fwd_fixed`` / ``bwd_fixed`` are the keyword arguments every call repeats, built once from the
    functions' argument names; ``causal_name`` is the backward's name for the causal flag.
    """

    fwd: Callable[..., Any]
    bwd: Callable[..., Any]
    fwd_fixed: dict[str, Any]
    bwd_fixed: dict[str, Any]
    causal_name: str
    name: str = "fa3"

    @classmethod
    def load(cls, interface: ModuleType, deterministic: bool = False) -> FlashAttn3:
        """Bind FA3's ``interface`` module; ValueError when it is the 2024 beta (other arguments and returns)."""
        fwd, bwd = interface._flash_attn_forward, interface._flash_attn_backward
        fwd_names, bwd_names = parameter_names(fwd), parameter_names(bwd)
        if "k_new" not in fwd_names:
            raise ValueError("flash_attn_interface is an FA3 beta from before 2025 (no k_new argument); "
                             "install a current FA3 build from flash-attention's hopper/ directory")
        fwd_fixed = _fixed_arguments(fwd_names, {"softcap": 0.0, **_window(fwd_names)})
        bwd_fixed = _fixed_arguments(bwd_names, {"softcap": 0.0, "deterministic": deterministic,
                                                 **_window(bwd_names)})
        causal_name = "is_causal" if "is_causal" in bwd_names else "causal"
        return cls(fwd, bwd, fwd_fixed, bwd_fixed, causal_name)

    def with_sm_margin(self, margin: int) -> FlashAttn3:
        """This kernel leaving ``margin`` SMs to others (FA3's ``sm_margin``): its persistent kernels would
        otherwise occupy every SM and starve the CP communication in flight during a ring step."""
        return replace(self, fwd_fixed={**self.fwd_fixed, "sm_margin": margin},
                       bwd_fixed={**self.bwd_fixed, "sm_margin": margin})

    native_window = True  # dense calls take FA3's window (``window=``)
    native_varlen = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                window: tuple[int, int] | None = None) -> OutLse:
        check_square_causal(self.name, q, k, causal)
        result = self.fwd(**{**with_window(self.fwd_fixed, window), "q": q, "k": k, "v": v, "softmax_scale": scale,
                             "causal": causal})
        return result[0], result[1]

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float, window: tuple[int, int] | None = None) -> QKVGrads:
        check_square_causal(self.name, rows.q, k, causal)
        dout, q, out, lse = rows
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.bwd(**{**with_window(self.bwd_fixed, window), "dout": dout.contiguous(), "q": q, "k": k, "v": v,
                    "out": out,
                    "softmax_lse": lse.contiguous(), "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale,
                    self.causal_name: causal})
        return dq, dk, dv

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse:
        cu_q, cu_k, max_q, max_k = segments
        result = self.fwd(**{**self.fwd_fixed, "q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                             "max_seqlen_q": max_q, "max_seqlen_k": max_k, "softmax_scale": scale, "causal": causal})
        return result[0], result[1]

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads:
        dout, q, out, lse = rows
        cu_q, cu_k, max_q, max_k = segments
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.bwd(**{**self.bwd_fixed, "dout": dout.contiguous(), "q": q, "k": k, "v": v, "out": out,
                    "softmax_lse": lse.contiguous(), "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale,
                    "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
                    self.causal_name: causal})
        return dq, dk, dv
