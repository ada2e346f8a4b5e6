"""Stand-ins for the flash-attn packages' private functions, with their exact signatures and returns.

``flash_attn_interface(version)`` returns a module object like ``flash_attn.flash_attn_interface`` of
that release: 2.5.x and 2.6.x plain functions (lse at index 5 of 8 values), 2.7.x and 2.8.x
``torch.library.custom_op`` objects (signature ``(*args, **kwargs)``, lse at index 1, the backward
mutating dq/dk/dv); FA3's are in ``fa3_standins.py``. The signatures were copied from the packages'
sources at those tags; the bodies compute attention with the float64 math kernel on any device, so a call that binds
or unpacks wrongly fails loudly or numerically. ``CALLS`` records each call's keyword arguments.
"""

import types
from typing import Optional  # noqa: UP035 - torch.library.custom_op reads these annotations

import torch

from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from cp_train.parallel.kernels.select import MathKernel, _math_scores
from cp_train.parallel.kernels.torch_ops import expand_kv, reduce_kv_grad
from cp_train.parallel.kernels.varlen import backward_by_segments, forward_by_segments

CALLS: list[dict] = []
_MATH = MathKernel()


def _attention(q, k, v, softmax_scale, causal):
    out, lse = _MATH.forward(q, k, v, causal, softmax_scale)
    return out.to(q.dtype), lse.float()


def _grads(dout, q, k, v, softmax_scale, causal, dq, dk, dv):
    """Closed-form float64 gradients (custom ops run below autograd, so no autograd here)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q64, do64 = q.double(), dout.double()
    k64, v64 = (expand_kv(x, heads).double() for x in (k, v))
    probs = torch.softmax(_math_scores(q, k, causal, softmax_scale), dim=-1).nan_to_num(0.0)  # [B, H, Sq, Sk]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v64)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", do64, v64)
    dscores = probs * (dprobs - (do64 * out).sum(-1).transpose(1, 2)[..., None])
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", dscores, k64) * softmax_scale)
    dk.copy_(reduce_kv_grad(torch.einsum("bhqk,bqhd->bkhd", dscores, q64) * softmax_scale, kv_heads))
    dv.copy_(reduce_kv_grad(torch.einsum("bhqk,bqhd->bkhd", probs, do64), kv_heads))


def _check_window(window_size):
    assert isinstance(window_size, tuple) and len(window_size) == 2, f"window_size must be a tuple: {window_size!r}"


class _ClosedForm:
    """A dense float64 kernel usable inside custom ops (no autograd), for the varlen stand-ins."""

    def forward(self, q, k, v, causal, scale):
        return _attention(q, k, v, scale, causal)

    def backward(self, rows, k, v, causal, scale):  # the given final out/lse, as the real kernels read them
        grads = _MATH.backward(rows, k, v, causal, scale)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (rows.q, k, v), strict=True))


_CLOSED = _ClosedForm()


def _padded(lse, cu, max_seqlen):
    """[H, T] -> flash-attn 2.5's per-sequence padded [sequences, H, max_seqlen], built segment by segment."""
    bounds = cu.tolist()
    padded = torch.zeros(len(bounds) - 1, lse.shape[0], max_seqlen)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        padded[i, :, : hi - lo] = lse[:, lo:hi]
    return padded


def _segments(cu_q, cu_k) -> VarlenSegments:
    """The offsets as the kernels' ``VarlenSegments`` (the maxima read back from them)."""
    longest = [int((cu[1:] - cu[:-1]).max()) for cu in (cu_q, cu_k)]
    return VarlenSegments(cu_q, cu_k, *longest)


def _unpadded(lse, cu):
    bounds = cu.tolist()
    return torch.cat([lse[i, :, : hi - lo] for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))],
                     dim=1)


def _varlen_attention(q, k, v, cu_q, cu_k, scale, causal):
    out, lse = forward_by_segments(_CLOSED, q, k, v, _segments(cu_q, cu_k), causal, scale)
    return out, lse.float()


def _varlen_grads(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, dq, dk, dv):
    gq, gk, gv = backward_by_segments(_CLOSED, BackwardRows(dout, q, out, lse), k, v, _segments(cu_q, cu_k), causal,
                                      scale)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)


# ----------------------------------------------------------------------------------- 2.5.x
def _fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    CALLS.append({"fn": "fwd", "dropout_p": dropout_p, "window_size": window_size, "alibi_slopes": alibi_slopes})
    _check_window(window_size)
    out, lse = _attention(q, k, v, softmax_scale, causal)
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
            alibi_slopes, deterministic, rng_state=None):
    CALLS.append({"fn": "bwd", "deterministic": deterministic, "lse_contiguous": softmax_lse.is_contiguous()})
    _check_window(window_size)
    _grads(dout, q, k, v, softmax_scale, causal, dq, dk, dv)
    return dq, dk, dv, softmax_lse.clone()


def _varlen_fwd_25(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, return_softmax):
    _check_window(window_size)
    CALLS.append({"fn": "varlen_fwd"})
    out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out, q, k, v, out, _padded(lse, cu_seqlens_q, max_seqlen_q), None, torch.zeros(2, dtype=torch.int64)


def _varlen_fwd_257(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, return_softmax, block_table):
    assert block_table is None
    return _varlen_fwd_25(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                          softmax_scale, causal, window_size, alibi_slopes, return_softmax)


def _varlen_bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                   rng_state=None):
    _check_window(window_size)
    assert softmax_lse.shape == (cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q), "2.5 takes the padded lse"
    CALLS.append({"fn": "varlen_bwd", "deterministic": deterministic})
    _varlen_grads(dout, q, k, v, out, _unpadded(softmax_lse, cu_seqlens_q), cu_seqlens_q, cu_seqlens_k,
                  softmax_scale, causal, dq, dk, dv)
    return dq, dk, dv, None


# ----------------------------------------------------------------------------------- 2.6.x
def _fwd_26(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert softcap == 0.0
    return _fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax)


def _bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, rng_state=None):
    assert softcap == 0.0
    return _bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, deterministic, rng_state)


def _varlen_fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                   block_table=None, leftpad_k=None, seqused_k=None):
    _check_window(window_size)
    CALLS.append({"fn": "varlen_fwd"})
    out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _varlen_fwd_260(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, return_softmax, block_table):
    """2.6.0 and 2.6.0.post1: every argument required (defaults came with 2.6.1)."""
    assert softcap == 0.0 and block_table is None
    return _varlen_fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                          causal, window_size, softcap, alibi_slopes, return_softmax)


def _varlen_bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   rng_state=None):
    _check_window(window_size)
    assert softmax_lse.shape == (q.shape[1], q.shape[0]), "2.6 takes the packed lse"
    CALLS.append({"fn": "varlen_bwd", "deterministic": deterministic})
    _varlen_grads(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, dq, dk, dv)
    return dq, dk, dv, None


# ------------------------------------------------------------------------- 2.7.x and 2.8.x
def _custom_op_interface(namespace: str) -> tuple:
    @torch.library.custom_op(f"{namespace}::_flash_attn_forward", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], return_softmax: bool  # noqa: UP045
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        CALLS.append({"fn": "fwd", "window": (window_size_left, window_size_right), "softcap": softcap})
        out, lse = _attention(q, k, v, softmax_scale, causal)
        return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

    @torch.library.custom_op(f"{namespace}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],  # noqa: UP045
                 dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,  # noqa: UP045
                 window_size_left: int, window_size_right: int, softcap: float,
                 alibi_slopes: Optional[torch.Tensor], deterministic: bool,  # noqa: UP045
                 rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
        CALLS.append({"fn": "bwd", "deterministic": deterministic, "lse_contiguous": softmax_lse.is_contiguous()})
        _grads(dout, q, k, v, softmax_scale, causal, dq, dk, dv)
        return softmax_lse.clone()

    return forward, backward


def _custom_op_varlen(namespace: str, zero_tensors: bool) -> tuple:
    """2.7's varlen custom ops; 2.8 adds ``zero_tensors`` (defaulted) to both."""
    T, OptT = torch.Tensor, Optional[torch.Tensor]  # noqa: N806, UP045

    def forward(q: T, k: T, v: T, cu_seqlens_q: T, cu_seqlens_k: T, max_seqlen_q: int, max_seqlen_k: int,
                dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
                window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: OptT = None,
                return_softmax: bool = False, block_table: OptT = None, leftpad_k: OptT = None,
                seqused_k: OptT = None) -> tuple[T, T, T, T]:
        CALLS.append({"fn": "varlen_fwd", "window": (window_size_left, window_size_right)})
        out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)

    def backward(dout: T, q: T, k: T, v: T, out: T, softmax_lse: T, dq: OptT, dk: OptT, dv: OptT,
                 cu_seqlens_q: T, cu_seqlens_k: T, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                 softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                 alibi_slopes: OptT, deterministic: bool, rng_state: OptT = None) -> T:
        CALLS.append({"fn": "varlen_bwd", "deterministic": deterministic})
        _varlen_grads(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, dq, dk, dv)
        return softmax_lse.clone()

    if zero_tensors:  # same bodies, one more defaulted argument
        plain_forward, plain_backward = forward, backward

        def forward(q: T, k: T, v: T, cu_seqlens_q: T, cu_seqlens_k: T, max_seqlen_q: int, max_seqlen_k: int,  # noqa: F811
                    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
                    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: OptT = None,
                    return_softmax: bool = False, block_table: OptT = None, leftpad_k: OptT = None,
                    seqused_k: OptT = None, zero_tensors: bool = False) -> tuple[T, T, T, T]:
            return plain_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                 softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                 return_softmax, block_table, leftpad_k, seqused_k)

        def backward(dout: T, q: T, k: T, v: T, out: T, softmax_lse: T, dq: OptT, dk: OptT, dv: OptT,  # noqa: F811
                     cu_seqlens_q: T, cu_seqlens_k: T, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                     softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, alibi_slopes: OptT, deterministic: bool, rng_state: OptT = None,
                     zero_tensors: bool = False) -> T:
            return plain_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                  window_size_right, softcap, alibi_slopes, deterministic, rng_state)

    return (torch.library.custom_op(f"{namespace}::_flash_attn_varlen_forward", forward, mutates_args=()),
            torch.library.custom_op(f"{namespace}::_flash_attn_varlen_backward", backward,
                                    mutates_args=("dq", "dk", "dv")))


_CUSTOM_OPS: dict[str, tuple] = {}


def flash_attn_interface(version: str) -> types.ModuleType:
    """A stand-in ``flash_attn.flash_attn_interface`` of ``version`` (2.5.x-2.8.x)."""
    module = types.ModuleType("flash_attn.flash_attn_interface")
    minor, patch = int(version.split(".")[1]), int(version.split(".")[2][0])
    if minor == 5:
        module._flash_attn_forward, module._flash_attn_backward = _fwd_25, _bwd_25
        module._flash_attn_varlen_forward = _varlen_fwd_257 if patch >= 7 else _varlen_fwd_25
        module._flash_attn_varlen_backward = _varlen_bwd_25
    elif minor == 6:
        module._flash_attn_forward, module._flash_attn_backward = _fwd_26, _bwd_26
        module._flash_attn_varlen_forward = _varlen_fwd_26 if patch >= 1 else _varlen_fwd_260
        module._flash_attn_varlen_backward = _varlen_bwd_26
    else:
        namespace = f"cptrain_standin_fa2{minor}"
        if namespace not in _CUSTOM_OPS:
            _CUSTOM_OPS[namespace] = _custom_op_interface(namespace) + _custom_op_varlen(namespace, minor >= 8)
        (module._flash_attn_forward, module._flash_attn_backward, module._flash_attn_varlen_forward,
         module._flash_attn_varlen_backward) = _CUSTOM_OPS[namespace]
    return module
