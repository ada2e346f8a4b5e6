"""Stand-ins for FA3's (flash-attn "hopper") private functions, with their exact signatures and returns.

``fa3_interface(form)`` returns FA3's ``flash_attn_interface``: ``"custom_op"`` (2025-07 and later) or
``"plain"`` (2025-03 to 2025-07: every argument positional, ``window_size`` tuple, ``causal`` in the
backward). The bodies compute with the float64 math kernel, and every call is recorded in
``flash_attn_standins.CALLS``, as for the flash-attn 2 stand-ins.
"""

import types
from typing import Optional  # noqa: UP035 - torch.library.custom_op reads these annotations

import torch

from tests.flash_attn_standins import (
    _CUSTOM_OPS,
    CALLS,
    _attention,
    _check_window,
    _grads,
    _varlen_attention,
    _varlen_grads,
)


def _fa3_plain_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                       seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                       rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                       window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                       scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    assert all(x is None for x in (k_new, v_new, qv, out, page_table, q_descale))
    _check_window(window_size)
    CALLS.append({"fn": "fwd", "sm_margin": sm_margin})
    if cu_seqlens_q is not None:
        out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    else:
        out, lse = _attention(q, k, v, softmax_scale, causal)
    return out, lse, None, None


def _fa3_plain_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                        max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                        softcap=0.0, deterministic=False, sm_margin=0):
    _check_window(window_size)
    CALLS.append({"fn": "bwd", "deterministic": deterministic, "lse_contiguous": softmax_lse.is_contiguous(),
                  "sm_margin": sm_margin})
    if cu_seqlens_q is not None:
        _varlen_grads(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, dq, dk, dv)
    else:
        _grads(dout, q, k, v, softmax_scale, causal, dq, dk, dv)
    return dq, dk, dv, softmax_lse.clone()


def _fa3_custom_op_interface() -> tuple:
    T, OptT = torch.Tensor, Optional[torch.Tensor]  # noqa: N806, UP045

    @torch.library.custom_op("cptrain_standin_fa3::_flash_attn_forward", mutates_args=())
    def forward(q: T, k: T, v: T, k_new: OptT = None, v_new: OptT = None, qv: OptT = None, out_: OptT = None,
                cu_seqlens_q: OptT = None, cu_seqlens_k: OptT = None, cu_seqlens_k_new: OptT = None,
                seqused_q: OptT = None, seqused_k: OptT = None, max_seqlen_q: Optional[int] = None,  # noqa: UP045
                max_seqlen_k: Optional[int] = None, page_table: OptT = None, kv_batch_idx: OptT = None,  # noqa: UP045
                leftpad_k: OptT = None, rotary_cos: OptT = None, rotary_sin: OptT = None,
                seqlens_rotary: OptT = None, q_descale: OptT = None, k_descale: OptT = None,
                v_descale: OptT = None, softmax_scale: Optional[float] = None, causal: bool = False,  # noqa: UP045
                window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0,
                softcap: float = 0.0, rotary_interleaved: bool = True, scheduler_metadata: OptT = None,
                num_splits: int = 1, pack_gqa: Optional[bool] = None, sm_margin: int = 0  # noqa: UP045
                ) -> tuple[T, T, T, T]:
        CALLS.append({"fn": "fwd", "window": (window_size_left, window_size_right)})
        if cu_seqlens_q is not None:
            out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        else:
            out, lse = _attention(q, k, v, softmax_scale, causal)
        return out, lse, torch.empty(0), torch.empty(0)

    @torch.library.custom_op("cptrain_standin_fa3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def backward(dout: T, q: T, k: T, v: T, out: T, softmax_lse: T, cu_seqlens_q: OptT = None,
                 cu_seqlens_k: OptT = None, sequed_q: OptT = None, sequed_k: OptT = None,
                 max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,  # noqa: UP045
                 dq: OptT = None, dk: OptT = None, dv: OptT = None, softmax_scale: Optional[float] = None,  # noqa: UP045
                 is_causal: bool = False, window_size_left: int = -1, window_size_right: int = -1,
                 softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0) -> T:
        CALLS.append({"fn": "bwd", "deterministic": deterministic, "lse_contiguous": softmax_lse.is_contiguous()})
        if cu_seqlens_q is not None:
            _varlen_grads(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, is_causal,
                          dq, dk, dv)
        else:
            _grads(dout, q, k, v, softmax_scale, is_causal, dq, dk, dv)
        return softmax_lse.clone()

    return forward, backward


def fa3_interface(form: str) -> types.ModuleType:
    """A stand-in FA3 ``flash_attn_interface``: ``"custom_op"`` (current) or ``"plain"`` (early 2025)."""
    module = types.ModuleType("flash_attn_interface")
    if form == "plain":
        module._flash_attn_forward, module._flash_attn_backward = _fa3_plain_forward, _fa3_plain_backward
    else:
        if "fa3" not in _CUSTOM_OPS:
            _CUSTOM_OPS["fa3"] = _fa3_custom_op_interface()
        module._flash_attn_forward, module._flash_attn_backward = _CUSTOM_OPS["fa3"]
    return module
