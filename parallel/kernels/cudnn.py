"""cuDNN's fused attention (PyTorch's cuDNN SDPA ops) behind the kernel contract (``contract.py``).

- forward: ``aten::_scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp,
  dropout_p, is_causal, return_debug_mask, *, scale)`` -> (output, logsumexp ``[B, H, Sq, 1]`` fp32, ...)
  (some releases allocate it ``[B, H, Sq]``: both are viewed as ``[B, H, Sq]``, anything else raises);
- backward: ``aten::_scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp,
  philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale)``.

Both take ``[B, H, S, D]``: the contract's ``[B, S, H, D]`` tensors go in as ``.transpose(1, 2)`` views. With
GQA the K/V heads go in as they are where this cuDNN build takes them (``native_gqa``, decided by
``trial.native_gqa_agrees`` on the device; the op's meta kernels take fewer K/V heads and return dK/dV in them),
else they are expanded by a packed copy (never a stride-0 view) and the gradients summed back. The backward is
given out and dout packed: PyTorch keys its cuDNN backward graphs on the q/k/v sizes and strides only, so the
out/dout strides of a key's first call would be assumed for every later one. fp16/bf16,
head_dim a multiple of 8 up to 128, sm80 or newer; whether a given cuDNN build runs a shape is only
known by calling it, so ``select_kernel`` admits this backend after a trial call. The backward's
dropout RNG tensors are never read at ``dropout_p = 0``; its ``attn_bias``/``cum_seq_q``/``cum_seq_k``
get None (an undefined tensor: no bias, dense inputs), as PyTorch's own autograd passes them. The dense
causal mask is used on square blocks only (``check_square_causal``).

Varlen calls (packed documents) go to ``varlen_kernel`` on a GPU (``select_kernel``: FA3 where installed on
Hopper, else flash-attn 2, else PyTorch's CUDA flash kernel): one varlen call per mask kind and ring step.
Measured on an H100 with the 1B config at 16k tokens, running them segment by segment through cuDNN
(``VarlenBySegments``, the fallback when ``varlen_kernel`` is None) cost one dense call per document and a host
sync per call: 12.5% MFU. The nested (THD) cuDNN path (``aten::_cudnn_attention_forward`` with
``cum_seq_q``/``cum_seq_k``) is not used: PyTorch's nested-tensor functions in ``ATen/native/cudnn/MHA.cpp`` look
their graph up but never store it (the 2026 sources read), so every call builds one, and the key holds the
segment count and longest segment anyway; its causal alignment for segments with more keys than queries differs
between cuDNN frontend versions. So by default the documents' steps go to varlen calls. The ``cudnn_ragged``
backend (``cudnn_ragged.py``, ``ragged_graphs``) runs them instead as one dense cuDNN call per document on views,
PyTorch's ragged dense graphs (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE``) keeping the graphs to one per power of two.
torch 2.13's own ``varlen_attn`` keeps its cuDNN branch off. cuDNN refuses a 1 x 1 block (``s_q = s_kv = 1``, seen
on an H200 with cuDNN 9.19 for a one-token piece of a document): those calls are computed exactly here
(``one_key_forward``).

Any other call shape cuDNN declines after admission (``cuDNN Frontend error``: "No valid execution plans built",
"No execution plans support the graph", reported on H200 and GH200 for shapes its trial did not cover) runs on
``varlen_kernel``'s dense entry instead (FA3, flash-attn 2 or PyTorch's CUDA flash, exact alike), once refused
never offered to cuDNN again (``refused``, per direction, shapes and mask), with one warning naming the shape:
the run goes on rather than stopping at hour ten on a document mix the warm-up did not see. Other errors (a
failed execution, a CUDA error) propagate.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from cp_train.parallel.kernels.contract import (
    AttentionKernel,
    BackwardRows,
    OutLse,
    QKVGrads,
    VarlenSegments,
    accumulator_dtype,
    check_square_causal,
)
from cp_train.parallel.kernels.torch_ops import expand_kv, reduce_kv_grad
from cp_train.parallel.kernels.varlen import VarlenBySegments

# the ops, looked up when called (tests replace them with CPU stand-ins); None where torch has no cuDNN SDPA
FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)
MAX_HEAD_DIM = 128
REFUSAL = "cuDNN Frontend error"  # PyTorch's message for a graph or plan cuDNN's frontend cannot build
CallKey = tuple[str, torch.Size, torch.Size, bool]  # (forward | backward, q's shape, k's shape, causal)


def cudnn_unavailable() -> str | None:
    """Why this torch cannot run cuDNN attention (None when it can: the ops exist and cuDNN is usable)."""
    if FORWARD is None or BACKWARD is None:
        return f"torch {torch.__version__} has no cuDNN SDPA ops (aten::_scaled_dot_product_cudnn_attention)"
    if not torch.backends.cudnn.is_available():
        return f"torch {torch.__version__} was built without cuDNN"
    return None


def one_key_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> OutLse:
    """A 1 x 1 block ([B, 1, H, D] q, [B, 1, Hk, D] k/v), exactly: one key, so out = v and lse = q.k * scale."""
    dtype, heads = accumulator_dtype(q.dtype), q.shape[2]
    lse = (q.to(dtype) * expand_kv(k, heads).to(dtype)).sum(-1).transpose(1, 2) * scale
    return expand_kv(v, heads).to(q.dtype).contiguous(), lse


def one_key_backward(rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, scale: float) -> QKVGrads:
    """The 1 x 1 block's gradients given the *final* out/lse of its rows (the block's probability is
    ``p = exp(q.k * scale - lse)``, 1 only when the block is the row's whole attention)."""
    dtype, heads, kv_heads = accumulator_dtype(rows.q.dtype), rows.q.shape[2], k.shape[2]
    dout, q, out = (x.to(dtype) for x in rows[:3])
    k_h, v_h = expand_kv(k, heads).to(dtype), expand_kv(v, heads).to(dtype)
    p = torch.exp((q * k_h).sum(-1) * scale - rows.lse.transpose(1, 2).to(dtype))[..., None]  # [B, 1, H, 1]
    ds = p * ((dout * v_h).sum(-1, keepdim=True) - (dout * out).sum(-1, keepdim=True)) * scale
    return ((ds * k_h).to(rows.q.dtype), reduce_kv_grad(ds * q, kv_heads).to(k.dtype),
            reduce_kv_grad(p * dout, kv_heads).to(v.dtype))


def op_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` as the ops take it, ``[B, H, S, D]`` (a view). With one sample the batch stride,
    which cuDNN never steps but keys its graphs on, is made the view's own extent: a row slice of a block and
    a block of its own rows then share one graph."""
    x = x.transpose(1, 2)
    if x.shape[0] != 1:
        return x
    extent = max(x.shape[1] * x.stride(1), x.shape[2] * x.stride(2))
    if x.stride(0) == extent:  # a block of its own rows: already so, no op dispatched
        return x
    return x.as_strided(x.shape, (extent, *x.stride()[1:]), x.storage_offset())


@dataclass(frozen=True)
class CudnnAttention(VarlenBySegments):
    """cuDNN SDPA (fp16/bf16, CUDA sm80+); varlen calls by ``varlen_kernel``'s varlen entry (None: by segments)."""

    name: str = "cudnn"
    varlen_kernel: AttentionKernel | None = None
    native_gqa: bool = False  # K/V with fewer heads go in as they are (no expanding copy)
    plans_per_shape: bool = True  # a graph per call shape and strides, per thread (the ring warms them: ring/warm.py)
    # PyTorch's ragged dense graphs (``cudnn_ragged.py``): one graph per power-of-two length, so the packed
    # documents' steps run as one dense call per document on views (not on ``varlen_kernel``)
    ragged_graphs: bool = False
    lse_rows_major: bool = False  # the backward takes lse [B, H, Sq] laid out [B, Sq, H] (``cudnn_ragged.trial``)
    # the dense calls cuDNN declined, run on varlen_kernel since (shared by the native_gqa copy of this kernel)
    refused: set[CallKey] = field(default_factory=set, compare=False, repr=False)

    def _instead(self, key: CallKey, error: RuntimeError) -> AttentionKernel:
        """The kernel to run a call cuDNN declined with ``error`` (``varlen_kernel``), the call remembered and
        warned about once; raises ``error`` itself when it is no refusal or there is no other kernel."""
        if self.varlen_kernel is None or REFUSAL not in str(error):
            raise error
        self.refused.add(key)
        reason = (str(error).strip().splitlines() or [""])[0]
        warnings.warn(f"cuDNN declined the attention {key[0]} of q {list(key[1])} and k {list(key[2])} (causal "
                      f"{key[3]}; {reason}): that call shape runs on {self.varlen_kernel.name} from now on",
                      RuntimeWarning, stacklevel=3)
        return self.varlen_kernel

    @property
    def native_varlen(self) -> bool:
        return self.varlen_kernel is not None and not self.ragged_graphs

    @property
    def varlen_rectangles(self) -> bool:
        """Whether the documents' full (non-causal) pieces of a ring step go to ``varlen_kernel`` as one varlen call
        while their causal squares stay dense calls (ragged graphs with a varlen kernel: at cp > 1 a document's
        pieces on two ranks pair any two powers of two, too many graphs to build ahead; ``ring/forward.py``)."""
        return self.ragged_graphs and self.varlen_kernel is not None

    def _kv(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """K or V ``[B, S, Hk, D]`` as the op takes it (``[B, Hk or H, S, D]``). Expanded heads are a packed copy:
        ``expand_kv``'s stride-0 view of one K/V head would hand cuDNN's graph a zero stride."""
        if not self.native_gqa and x.shape[2] != heads:
            x = expand_kv(x, heads).contiguous()
        return op_view(self._packed(x))

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the op gets it: with ragged graphs ``[B, S, H, D]`` contiguous (a head chunk's view copied;
        a row slice is already), which PyTorch's ragged path needs to share graphs across lengths."""
        return x.contiguous() if self.ragged_graphs else x

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse:
        if self.varlen_kernel is None:
            return super().varlen_forward(q, k, v, segments, causal, scale)
        return self.varlen_kernel.varlen_forward(q, k, v, segments, causal, scale)

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads:
        if self.varlen_kernel is None:
            return super().varlen_backward(rows, k, v, segments, causal, scale)
        return self.varlen_kernel.varlen_backward(rows, k, v, segments, causal, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> OutLse:
        check_square_causal(self.name, q, k, causal)
        heads = q.shape[2]
        if q.shape[1] == k.shape[1] == 1:  # cuDNN refuses s_q = s_kv = 1 (a one-token document's block)
            return one_key_forward(q, k, v, scale)
        if self.refused and ("forward", q.shape, k.shape, causal) in self.refused:  # nothing per call until then
            return self.varlen_kernel.forward(q, k, v, causal, scale)
        try:
            out, lse = FORWARD(op_view(self._packed(q)), self._kv(k, heads), self._kv(v, heads), None, True, 0.0,
                               causal, False, scale=scale)[:2]
        except RuntimeError as error:
            return self._instead(("forward", q.shape, k.shape, causal), error).forward(q, k, v, causal, scale)
        return out.transpose(1, 2), lse.view(q.shape[0], heads, q.shape[1])  # [B, H, Sq, 1]; raises if not so

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> QKVGrads:
        dout, q, out, lse = rows
        check_square_causal(self.name, q, k, causal)
        heads, kv_heads = q.shape[2], k.shape[2]
        if q.shape[1] == k.shape[1] == 1:
            return one_key_backward(rows, k, v, scale)
        if self.refused and ("backward", q.shape, k.shape, causal) in self.refused:
            return self.varlen_kernel.backward(rows, k, v, causal, scale)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's RNG seed and offset: never read
        # PyTorch keys its backward graphs on q/k/v alone and bakes in the first call's out/dout strides: packed,
        # they are the same for every call of a key (a copy only of a row slice or head chunk of a batch)
        dout_packed, out_packed = dout.contiguous(), out.contiguous()
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2) if self.lse_rows_major else lse.contiguous()
        try:
            dq, dk, dv = BACKWARD(
                op_view(dout_packed), op_view(self._packed(q)), self._kv(k, heads), self._kv(v, heads),
                op_view(out_packed), lse.unsqueeze(-1), seed, seed, None, None, None, q.shape[1], k.shape[1], 0.0,
                causal, scale=scale)
        except RuntimeError as error:
            return self._instead(("backward", q.shape, k.shape, causal), error).backward(rows, k, v, causal, scale)
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)
