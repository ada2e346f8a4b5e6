"""cuDNN attention with graphs shared across lengths: the ``cudnn_ragged`` backend (``select.py``).

PyTorch's switch ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (``use_ragged_in_dense`` in ``ATen/native/cudnn/MHA.cpp``,
torch 2.9 and later) runs a dense cuDNN SDPA call whose q, k, v and out are laid out ``[B, S, H, D]`` (the kernel
contract's layout, row slices included) with ragged offsets and a padding mask, and keys its graph on the rows and
keys rounded up to powers of two, without the batch stride (``graph_key``). Packed documents can then run as one
dense cuDNN call per document on views of the packed rows: nothing gathered, cuDNN's dense speed, and at most
``log2(rows) + 1`` lengths per direction and mask, where one graph per document shape would be new in almost
every micro-batch. ``CudnnAttention(ragged_graphs=True)`` has no varlen entry of its own (``native_varlen`` False),
so the ring runs the documents' steps as those dense calls; above cp 1 their full (non-causal) pieces, whose
(rows, keys) pairs are any two powers of two, go to its varlen kernel as one call per step (``varlen_rectangles``,
``AttentionSpec.rectangles``), so the graphs are the causal squares' and the layout's, all built by the warm-up.

PyTorch reads the switch once, at a process's first cuDNN SDPA call: ``enable`` sets it before the backend's trial
call. The trial (``trial``) checks what the switch promises on the device: a causal GQA forward and backward at two
lengths of one power-of-two bucket, the second on the first's graph, each against the float64 reference; the lse
handed back to the backward in whichever layout the build reads (PyTorch's ragged forward allocates it
``[B, Sq, H]`` underneath, and releases differ in what the backward's graph assumes); and a call on the shared
graph costing less than a quarter of one that builds a graph (a process that made a cuDNN call before the switch
was set builds a graph per length, and fails here, saying so).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch

from cp_train.parallel.kernels.contract import BackwardRows
from cp_train.parallel.kernels.cudnn import CudnnAttention
from cp_train.parallel.kernels.reference import MathKernel
from cp_train.parallel.kernels.trial import relative_error, tolerance

SWITCH = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
# per lse layout tried, two lengths of one power-of-two bucket (128, 256): the second runs on the first's graph;
# each layout its own bucket, so that a graph built for one layout is never reused by the next
SHARED_LENGTHS = ((80, 72), (160, 144))
NEW_BUCKET_LENGTH = 40  # a length of another bucket (64): its call builds a graph
SHARED_COST = 0.25  # a call on a shared graph costs less than this fraction of one that builds a graph


def enable() -> None:
    """Set PyTorch's switch for this process (it takes effect if no cuDNN SDPA call has run yet)."""
    os.environ[SWITCH] = "1"


def documents_on_varlen(kernel: CudnnAttention) -> CudnnAttention:
    """``kernel`` (ragged graphs, admitted by ``trial``) with the documents on its varlen kernel: the ``cudnn``
    backend of a process whose switch is on (its dense calls run on ragged graphs too, so they need the lse layout
    the trial found; a ``cudnn`` selected there by name runs its own trial with the default layout)."""
    return dataclasses.replace(kernel, name="cudnn", ragged_graphs=False)


def bshd_packed(x: torch.Tensor) -> bool:
    """Whether ``x`` ``[B, S, H, D]`` is laid out as PyTorch's ragged path requires (``[B, S, H, D]`` contiguous;
    the strides of size-one dims do not count): a row slice of a packed block is, a head slice is not."""
    return x.is_contiguous()


def power_of_two(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for 0), as PyTorch rounds lengths in its graph key."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def graph_key(kind: str, causal: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The graph PyTorch's cache would hold for a dense call (contract layout ``[B, S, H, D]``) with the switch
    on: lengths rounded to powers of two when q, k and v are ``bshd_packed`` (batch, heads, head dim, dtype and
    mask as they are; first item "ragged"), else the exact sizes and strides past the batch (the ordinary dense
    key; "exact")."""
    if all(bshd_packed(x) for x in (q, k, v)):
        lengths = (power_of_two(q.shape[1]), power_of_two(k.shape[1]))
        return "ragged", kind, causal, q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.dtype, lengths
    layouts = tuple((tuple(x.shape), x.stride()[x.shape[0] == 1:]) for x in (q, k, v))
    return "exact", kind, causal, q.dtype, layouts


def _synchronized(device: torch.device) -> Callable[[], float]:
    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


def _forward_backward(kernel: CudnnAttention, tensors: tuple[torch.Tensor, ...], causal: bool, scale: float
                      ) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = tensors
    out, lse = kernel.forward(q, k, v, causal, scale)
    return (out, lse, *kernel.backward(BackwardRows(dout, q, out, lse), k, v, causal, scale))


def _inputs(rows: int, keys: int, device: torch.device, dtype: torch.dtype, head_dim: int
            ) -> tuple[torch.Tensor, ...]:
    """q, dout of ``rows`` rows and k, v of ``keys`` as a ring's packed rows are: row slices of a longer block
    (GQA, 4 query heads on 2)."""
    gen = torch.Generator(device=device).manual_seed(rows + keys)

    def block(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, 512, heads, head_dim, generator=gen, device=device).to(dtype)[:, 8:8 + length]

    return block(4, rows), block(2, keys), block(2, keys), block(4, rows)


def _exact(kernel: CudnnAttention, length: int, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when a causal call of ``length`` rows and a full one of ``length`` rows on twice the keys (a document's
    pieces on a ring) match float64 forward and backward, else what is off."""
    scale = head_dim ** -0.5
    for causal, keys in ((True, length), (False, 2 * length)):
        tensors = _inputs(length, keys, device, dtype, head_dim)
        got = _forward_backward(kernel, tensors, causal, scale)
        want = _forward_backward(MathKernel(), tuple(x.double() for x in tensors), causal, scale)  # type: ignore
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
            error = relative_error(a, b)
            if not error <= tolerance(dtype):
                return f"{'causal' if causal else 'full'} {name} at {length} rows off float64 by {error:.1e}"
    return None


def trial(kernel: CudnnAttention, device: torch.device, dtype: torch.dtype, head_dim: int,
          clock: Callable[[], float] | None = None) -> CudnnAttention:
    """``kernel`` with ragged graphs, once its calls on this device are exact and share graphs (module docstring):
    the backward's lse layout is the first that passes. RuntimeError saying what failed otherwise."""
    clock = clock or _synchronized(device)
    failures = []
    for rows_major, lengths in zip((True, False), SHARED_LENGTHS, strict=True):
        candidate = dataclasses.replace(kernel, name="cudnn_ragged", ragged_graphs=True, lse_rows_major=rows_major)
        failure = next(filter(None, (_exact(candidate, n, device, dtype, head_dim) for n in lengths)), None)
        if failure is None:
            break
        failures.append(f"lse {'rows' if rows_major else 'heads'}-major: {failure}")
    else:
        raise RuntimeError("cuDNN's ragged dense calls are not exact here (" + "; ".join(failures) + ")")
    third = lengths[1] - 1  # a third length of the shared bucket
    scale = head_dim ** -0.5
    began = clock()
    _forward_backward(candidate, _inputs(third, third, device, dtype, head_dim), True, scale)
    shared = clock() - began
    began = clock()
    _forward_backward(candidate, _inputs(NEW_BUCKET_LENGTH, NEW_BUCKET_LENGTH, device, dtype, head_dim), True, scale)
    building = clock() - began
    if not shared < SHARED_COST * building:
        raise RuntimeError(f"cuDNN built a graph per length ({1e3 * shared:.1f} ms for a length of a bucket it had, "
                           f"{1e3 * building:.1f} ms for a new bucket): {SWITCH}=1 must be set before the process "
                           f"makes its first cuDNN attention call")
    return candidate
