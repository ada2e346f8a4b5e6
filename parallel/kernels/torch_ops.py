"""PyTorch's own attention kernels behind the kernel contract (``contract.py``).

- ``TorchCpuFlash``: ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward); any float dtype, any
  head_dim; deterministic (a fixed reduction order for a fixed thread count).
- ``TorchCudaFlash``: ``_flash_attention_forward``/``_backward`` (the flash-attn 2 kernels inside
  PyTorch); fp16/bf16, head_dim a multiple of 8 up to 256, GQA natively, ``[B, S, H, D]`` as is.
  Its backward is deterministic only under ``torch.use_deterministic_algorithms(True)``:
  ``deterministic=True`` switches that on for the duration of each backward call.
- ``TorchEfficient``: ``_efficient_attention_forward``/``_backward`` (memory-efficient attention,
  the kernels behind ``_scaled_dot_product_efficient_attention``); CUDA fp32 (and fp16/bf16),
  ``[B, S, H, D]`` as is, K/V heads expanded for GQA. Its lse comes padded to a multiple of 32
  rows: the forward slices it, the backward gets a dense padded copy. ``deterministic=True``
  turns the backward's key splitting off (``num_splits_key=1``), which makes it deterministic.

Causal masks are aligned top-left by the CPU and efficient kernels and bottom-right by the CUDA
flash kernel: the ring uses causal masks only on square blocks, where all agree, and every dense call
refuses a rectangular causal block (``check_square_causal``: a shape comparison).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cp_train.parallel.kernels.contract import BackwardRows, OutLse, QKVGrads, VarlenSegments, check_square_causal
from cp_train.parallel.kernels.varlen import VarlenBySegments, lse_from_padded, lse_to_padded

LSE_ROW_ALIGNMENT = 32  # the efficient kernels' lse rows are padded to this multiple
CAUSAL_FROM_TOP_LEFT, CAUSAL_FROM_BOTTOM_RIGHT = 1, 2  # the efficient kernels' custom_mask_type values


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, Hk, D] -> [B, S, heads, D]; a stride-0 view when Hk == 1, else a copy."""
    kv_heads = x.shape[2]
    if kv_heads == heads:
        return x
    if kv_heads == 1:
        return x.expand(-1, -1, heads, -1)
    b, s, _, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv_heads, heads // kv_heads, d).reshape(b, s, heads, d)


def reduce_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the expanded heads' gradients back onto the kv heads: [B, S, H, D] -> [B, S, Hk, D]."""
    b, s, heads, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.reshape(b, s, kv_heads, heads // kv_heads, d).sum(dim=3)


@dataclass(frozen=True)
class TorchCpuFlash(VarlenBySegments):
    """PyTorch's CPU flash attention (the ring's CPU kernel)."""

    name: str = "torch cpu flash"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> OutLse:
        check_square_causal(self.name, q, k, causal)
        heads = q.shape[2]
        k, v = expand_kv(k, heads), expand_kv(v, heads)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        return out.transpose(1, 2), lse

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> QKVGrads:
        check_square_causal(self.name, rows.q, k, causal)
        dout, q, out, lse = rows
        heads, kv_heads = q.shape[2], k.shape[2]
        ke, ve = expand_kv(k, heads), expand_kv(v, heads)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2), out.transpose(1, 2),
            lse, 0.0, causal, scale=scale)
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside the block when ``enabled`` (restored after)."""
    was_on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if not enabled or (was_on and not warn_only):
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warn_only)


def _window_kwargs(window: tuple[int, int] | None) -> dict[str, int]:
    """PyTorch's flash op's window keywords for flash-attn's ``window`` (none: the op's defaults)."""
    return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}


@dataclass(frozen=True)
class TorchCudaFlash:
    """PyTorch's CUDA flash attention (fp16/bf16)."""

    deterministic: bool = False
    name: str = "torch cuda flash"

    native_window = True  # dense calls take window_size_left/right (``window=``, flash-attn's form)
    native_varlen = True  # varlen calls of its own (``contract.py``)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                window: tuple[int, int] | None = None) -> OutLse:
        check_square_causal(self.name, q, k, causal)
        out, lse = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                           False, scale=scale, **_window_kwargs(window))[:2]
        return out, lse

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float, window: tuple[int, int] | None = None) -> QKVGrads:
        check_square_causal(self.name, rows.q, k, causal)
        return self._backward(rows, k, v, None, None, rows.q.shape[1], k.shape[1], causal, scale, window)

    def _backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor | None,
                  cu_k: torch.Tensor | None, max_q: int, max_k: int, causal: bool, scale: float,
                  window: tuple[int, int] | None = None) -> QKVGrads:
        """Both backwards: dense with no offsets (``cu_q``/``cu_k`` None, the maxima the sequence lengths)."""
        dout, q, out, lse = rows
        rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)  # dropout's RNG state: never read
        with deterministic_algorithms(self.deterministic):
            return torch.ops.aten._flash_attention_backward(
                dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state,
                rng_state[0], scale=scale, **_window_kwargs(window))

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse:
        cu_q, cu_k, max_q, max_k = segments
        out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                           scale=scale)[:2]
        return out, lse

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads:
        return self._backward(rows, k, v, *segments, causal, scale)


def aligned_rows(rows: int) -> int:
    """``rows`` rounded up to the efficient kernels' lse alignment."""
    return -(-rows // LSE_ROW_ALIGNMENT) * LSE_ROW_ALIGNMENT


def padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """A dense [B, H, rows] copy of ``lse`` with rows rounded up to ``LSE_ROW_ALIGNMENT`` (padding 0)."""
    batch, heads, rows = lse.shape
    dense = lse.new_zeros(batch, heads, aligned_rows(rows))
    dense[:, :, :rows] = lse
    return dense


@dataclass(frozen=True)
class TorchEfficient:
    """PyTorch's CUDA memory-efficient attention (fp32, fp16, bf16)."""

    deterministic: bool = False
    name: str = "torch efficient"
    native_varlen = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> OutLse:
        check_square_causal(self.name, q, k, causal)
        heads = q.shape[2]
        out, lse = torch.ops.aten._efficient_attention_forward(
            q, expand_kv(k, heads), expand_kv(v, heads), None, None, None, None, None, 0.0,
            CAUSAL_FROM_TOP_LEFT if causal else 0, True, scale=scale)[:2]
        return out, lse[:, :, : q.shape[1]]

    def backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> QKVGrads:
        check_square_causal(self.name, rows.q, k, causal)
        dout, q, out, lse = rows
        heads, kv_heads = q.shape[2], k.shape[2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's RNG seed and offset: never read
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout, q, expand_kv(k, heads), expand_kv(v, heads), None, out.contiguous(), None, None, q.shape[1],
            k.shape[1], padded_lse(lse), 0.0, seed, seed, CAUSAL_FROM_TOP_LEFT if causal else 0, False,
            scale=scale, num_splits_key=1 if self.deterministic else None)
        return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                       causal: bool, scale: float) -> OutLse:
        cu_q, cu_k, max_q, max_k = segments
        heads = q.shape[1]
        out, lse = torch.ops.aten._efficient_attention_forward(
            q[None], expand_kv(k[None], heads), expand_kv(v[None], heads), None, cu_q, cu_k, max_q, max_k, 0.0,
            CAUSAL_FROM_BOTTOM_RIGHT if causal else 0, True, scale=scale)[:2]
        return out[0], lse_from_padded(lse, cu_q, q.shape[0])

    def varlen_backward(self, rows: BackwardRows, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, scale: float) -> QKVGrads:
        dout, q, out, lse = rows
        cu_q, cu_k, max_q, max_k = segments
        heads, kv_heads = q.shape[1], k.shape[1]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout[None], q[None], expand_kv(k[None], heads), expand_kv(v[None], heads), None, out[None].contiguous(),
            cu_q, cu_k, max_q, max_k, lse_to_padded(lse, cu_q, aligned_rows(max_q)), 0.0, seed, seed,
            CAUSAL_FROM_BOTTOM_RIGHT if causal else 0, False, scale=scale,
            num_splits_key=1 if self.deterministic else None)
        return dq[0], reduce_kv_grad(dk, kv_heads)[0], reduce_kv_grad(dv, kv_heads)[0]
