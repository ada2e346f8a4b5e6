"""Rank-side checks of the ring attention, run inside spawned gloo worlds (see test_ring_attention.py).

Each function runs on every rank, builds the same full-sequence inputs from a
seed, runs the ring on its slice, gathers the results and returns relative
errors against the float64 math reference on the full sequence.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from cp_train.parallel.cp import spec as spec_module
from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.dropins import ring_flash_attn_func, stripe_flash_attn_func, zigzag_ring_flash_attn_func
from cp_train.parallel.cp.layout import gather_sequence, shard_sequence
from cp_train.parallel.kernels import select as kernels
from tests.numerics import rel_err


class CountingKernel:
    """An attention kernel that counts its calls into ``calls`` (everything else delegated): a dense or a varlen
    forward as one "forward", a backward as one "backward". The library keeps no counters."""

    COUNTED = {"forward": "forward", "varlen_forward": "forward", "backward": "backward",
               "varlen_backward": "backward"}

    def __init__(self, kernel: Any, calls: Counter[str]) -> None:
        self.kernel, self.calls = kernel, calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.kernel, name)
        if name not in self.COUNTED:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[self.COUNTED[name]] += 1
            return attribute(*args, **kwargs)
        return counted


@contextlib.contextmanager
def counting_kernels() -> Iterator[Counter[str]]:
    """Inside: every kernel ``build_spec`` selects is a ``CountingKernel`` adding to the Counter yielded (the
    test hook; outside it, and by default, kernels are the library's own)."""
    calls: Counter[str] = Counter()
    original = spec_module.select_kernel

    def select(*args: Any, **kwargs: Any) -> CountingKernel:
        return CountingKernel(original(*args, **kwargs), calls)

    spec_module.select_kernel = select
    try:
        yield calls
    finally:
        spec_module.select_kernel = original

API = {"contiguous": ring_flash_attn_func, "zigzag": zigzag_ring_flash_attn_func,
       "stripe": stripe_flash_attn_func}


def full_inputs(seqlen: int, heads: int, kv_heads: int, dim: int, seed: int, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, dim, generator=gen)
    k = torch.randn(batch, seqlen, kv_heads, dim, generator=gen)
    v = torch.randn(batch, seqlen, kv_heads, dim, generator=gen)
    dout = torch.randn(batch, seqlen, heads, dim, generator=gen)
    return q, k, v, dout


def reference(q, k, v, dout, causal: bool):
    out, lse = kernels.flash_forward(q, k, v, causal, backend="math")
    dq, dk, dv = kernels.flash_backward(dout, q, k, v, out, lse, causal, backend="math")
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def run_ring(q, k, v, dout, layout: str, causal: bool, use_api: bool, head_chunks: int | None = None,
             overlap: bool | None = None):
    """Shard, run fwd+bwd on this rank, gather; returns the full-sequence results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [shard_sequence(x, rank, world, layout).requires_grad_(x is not dout) for x in (q, k, v, dout)]
    ql, kl, vl, dl = local
    if use_api:
        out, lse, none = API[layout](ql, kl, vl, causal=causal, return_attn_probs=True)
        assert none is None
    else:
        out, lse = context_parallel_attention(ql, kl, vl, dist.group.WORLD, layout, causal, head_chunks=head_chunks,
                                              return_lse=True, overlap=overlap)
    out.backward(dl)
    got = {"out": out.detach(), "lse": lse.transpose(1, 2).contiguous(), "dq": ql.grad, "dk": kl.grad,
           "dv": vl.grad}
    got = {name: gather_sequence(x, None, layout) for name, x in got.items()}
    got["lse"] = got["lse"].transpose(1, 2)
    return got


def check_fp32(seqlen: int, heads: int, kv_heads: int, layout: str, causal: bool, use_api: bool,
               head_chunks: int | None = None, dim: int = 16, seed: int = 0,
               overlap: bool | None = None) -> dict[str, float]:
    """Relative errors of out, lse, dq, dk, dv (fp32 ring vs float64 reference)."""
    q, k, v, dout = full_inputs(seqlen, heads, kv_heads, dim, seed)
    ref = reference(q, k, v, dout, causal)
    got = run_ring(q, k, v, dout, layout, causal, use_api, head_chunks, overlap)
    for name, x in got.items():
        assert x.dtype == torch.float32 and x.shape == ref[name].shape, (name, x.dtype, x.shape)
    return {name: rel_err(got[name], ref[name]) for name in ref}


def check_forward_chunks(seqlen: int, heads: int, kv_heads: int, layout: str, causal: bool,
                         head_chunks: int | None) -> dict[str, float]:
    """A forward with ``head_chunks`` (None: the default, one chunk): relative errors of out and lse, and
    its kernel calls on this rank."""
    q, k, v, dout = full_inputs(seqlen, heads, kv_heads, 16, seed=5)
    ref = reference(q, k, v, dout, causal)
    rank, world = dist.get_rank(), dist.get_world_size()
    ql, kl, vl = (shard_sequence(x, rank, world, layout) for x in (q, k, v))
    with torch.no_grad(), counting_kernels() as counted:
        out, lse = context_parallel_attention(ql, kl, vl, dist.group.WORLD, layout, causal, head_chunks=head_chunks,
                                              return_lse=True)
    calls = counted["forward"]
    out = gather_sequence(out, None, layout)
    lse = gather_sequence(lse.transpose(1, 2).contiguous(), None, layout).transpose(1, 2)
    return {"out": rel_err(out, ref["out"]), "lse": rel_err(lse, ref["lse"]), "calls": calls}


def check_bf16(seqlen: int, heads: int, kv_heads: int, layout: str, causal: bool) -> dict[str, tuple]:
    """(ring bf16 error, local single-process bf16 kernel error) per tensor, both vs float64."""
    q, k, v, dout = full_inputs(seqlen, heads, kv_heads, 32, seed=1)
    ref = reference(q, k, v, dout, causal)
    qb, kb, vb, db = (x.bfloat16() for x in (q, k, v, dout))
    local_out, local_lse = kernels.flash_forward(qb, kb, vb, causal)
    local = dict(zip(("dq", "dk", "dv"), kernels.flash_backward(db, qb, kb, vb, local_out, local_lse, causal),
                     strict=True))
    local["out"] = local_out
    got = run_ring(qb, kb, vb, db, layout, causal, use_api=False)
    assert got["out"].dtype == torch.bfloat16 and got["dk"].dtype == torch.bfloat16
    return {name: (rel_err(got[name], ref[name]), rel_err(local[name], ref[name])) for name in local}


def count_kernel_calls(seqlen: int, heads: int, kv_heads: int, layout: str, causal: bool,
                       head_chunks: int) -> dict[str, int]:
    """Kernel calls this rank made for one forward and one backward."""
    q, k, v, dout = full_inputs(seqlen, heads, kv_heads, 8, seed=2, batch=1)
    with counting_kernels() as counted:
        run_ring(q, k, v, dout, layout, causal, use_api=False, head_chunks=head_chunks)
    return dict(counted)
