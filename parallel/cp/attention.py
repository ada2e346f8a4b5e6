"""Context-parallel attention: one entry point for every CP algorithm (ring, all-gather, Ulysses, hybrid).

``context_parallel_attention(q, k, v, group, layout, causal, ...)`` takes this rank's slice of the
sequence, ``[batch, local_seqlen, heads, head_dim]`` in the CP ``layout`` (``parallel/layout.py``), and
returns this rank's output slice. It builds one frozen ``AttentionSpec`` (or takes ``spec=``) and one
per-batch ``CPPlan`` (or takes ``plan=``; ``attention_plan`` builds it once for all layers) and
dispatches on ``spec.algorithm`` to ``ring_attention``, ``allgather_attention`` or
``ulysses_attention`` (hybrid included). ``group`` is the CP process group, or ``CPGroups`` with the
Ulysses and ring subgroups for ``hybrid``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cp_train.parallel.cp.algorithms import canonical_algorithm, check_heads
from cp_train.parallel.cp.allgather import allgather_attention
from cp_train.parallel.cp.layout import LAYOUTS
from cp_train.parallel.cp.plan.batch_plan import CPPlan, build_cp_plan
from cp_train.parallel.cp.ring.attention import ring_attention
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.cp.ulysses.attention import ulysses_attention
from cp_train.parallel.kernels.select import BACKENDS, select_kernel
from cp_train.parallel.mesh.groups import CPGroups

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _many_small_calls(plan: CPPlan | None) -> bool:
    """Whether packed documents make each step many small kernel calls (the same on every rank)."""
    return plan is not None and plan.max_calls > 4


def default_head_chunks(device: torch.device, kv_heads: int, plan: CPPlan | None = None,
                        rows_per_kv_head: int = 1) -> int:
    """The ring backward's (and the all-gather's) kv-head chunks; the ring forward runs in one
    (``AttentionSpec``). Two on GPUs, so that the backward's last dK/dV hop of one chunk travels during the next chunk's
    compute. On CPU as many chunks as leave every thread work: PyTorch's CPU flash backward spreads its
    threads over (batch x query heads) only, and ``rows_per_kv_head`` is that product per kv head; at one
    thread per rank that is one kv head per chunk, which bounds the transient buffers at no speed cost.
    One chunk without a ring (one rank: nothing travels) and when packed documents make many small calls
    (small calls run slower, and their buffers are small anyway). The same on every rank."""
    if device.type != "cpu":
        return min(2, kv_heads)
    if _many_small_calls(plan) or (plan is not None and len(plan.areas) == 1):
        return 1
    per_chunk = -(-torch.get_num_threads() // max(1, rows_per_kv_head))
    return max(1, kv_heads // per_chunk)


def default_overlap(device: torch.device, plan: CPPlan | None = None) -> bool:
    """The ring backward's overlap policy (see ``ring_grads``): on for GPUs; on CPU only with packed documents.
    There a rank's split of work between the local and the remote steps differs from its neighbours' even
    when the totals match (the balanced layout), so hops that wait in place would make every step as slow
    as its slowest rank; posted early, only the totals count, and the hops carry few rows. With one
    document every step is equal on every rank and memory comes first."""
    return device.type != "cpu" or _many_small_calls(plan)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, world: int) -> None:
    """Raise ``ValueError`` saying what to change when q/k/v cannot go through context parallelism."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [batch, seqlen, heads, head_dim], got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; attention needs a floating dtype "
                             "(float16, bfloat16, float32 or float64)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local seqlen "
                         "and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    n = q.shape[1]
    if n == 0:
        raise ValueError("the local sequence is empty")
    if layout == "zigzag" and n % 2 != 0:
        raise ValueError(f"zigzag needs an even local sequence length, got {n}: make the global sequence "
                         f"length ({n * world}) a multiple of 2*cp = {2 * world}")


def as_groups(group: dist.ProcessGroup | CPGroups | None) -> CPGroups:
    return group if isinstance(group, CPGroups) else CPGroups(group)


def attention_plan(group: dist.ProcessGroup | CPGroups | None, layout: str, causal: bool, local_len: int,
                   document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   algorithm: str = "ring") -> CPPlan | None:
    """This batch's plan (see ``cp_plan.build_cp_plan``): build it once and pass it to every layer."""
    return build_cp_plan(canonical_algorithm(algorithm), as_groups(group), layout, causal, local_len, document_ids,
                         position_ids)


def make_spec(q: torch.Tensor, k: torch.Tensor, algorithm: str = "ring", layout: str = "zigzag",
              causal: bool = True, softmax_scale: float | None = None, backend: str | None = None,
              head_chunks: int | None = None, deterministic: bool | None = None, overlap: bool | None = None,
              plan: CPPlan | None = None) -> AttentionSpec:
    """The spec of a call site for tensors like ``q``/``k`` (see ``context_parallel_attention``)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    batch = 1 if plan is not None and plan.packed else q.shape[0]  # packed plans fold the batch into rows
    forward_head_chunks = head_chunks or 1  # asked for: both ways; by default the forward runs in one
    if head_chunks is None:
        head_chunks = default_head_chunks(q.device, k.shape[2], plan, batch * q.shape[2] // k.shape[2])
    return AttentionSpec(
        algorithm=canonical_algorithm(algorithm), layout=layout, causal=causal,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        kernel=select_kernel(q.device, q.dtype, q.shape[-1], backend, deterministic),
        head_chunks=head_chunks,
        overlap=default_overlap(q.device, plan) if overlap is None else overlap, varlen=q.device.type == "cuda",
        forward_head_chunks=forward_head_chunks)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | CPGroups | None, layout: str = "zigzag",
                               causal: bool = True, softmax_scale: float | None = None, backend: str | None = None,
                               head_chunks: int | None = None, return_lse: bool = False,
                               deterministic: bool | None = None, overlap: bool | None = None,
                               document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                               plan: CPPlan | None = None, algorithm: str = "ring",
                               spec: AttentionSpec | None = None):
    """Exact attention of this rank's q on the whole sequence's k/v, over the CP group.

    q [B, n, H, D]; k, v [B, n, Hk, D] (GQA when Hk < H), all in ``layout``. ``group`` None (or a
    group of one) means no context parallelism: the local kernel on this sequence. Returns out
    [B, n, H, D] in q's dtype (and lse [B, H, n] fp32 if ``return_lse``). ``algorithm``: ring,
    allgather, ulysses or hybrid (``attention_spec.py``; hybrid needs ``CPGroups``). ``backend`` picks
    the kernel (``parallel/kernels.py``); ``deterministic`` (None: ``torch.are_deterministic_algorithms_
    enabled()``) asks for deterministic backwards; ``head_chunks`` and ``overlap`` tune the ring
    (defaults: ``default_head_chunks`` for the backward and one chunk for the forward; ``head_chunks`` given
    applies both ways; ``default_overlap``). ``document_ids`` [B, n] (non-decreasing
    along each sample) keep attention inside each document; ``position_ids`` order tokens within one
    (default: the layout's; needed by the ``balanced`` layout). ``plan`` (``attention_plan``) and
    ``spec`` (``make_spec``) skip rebuilding them.
    """
    groups = as_groups(group)
    check_inputs(q, k, v, layout, groups.size)
    algorithm = spec.algorithm if spec is not None else canonical_algorithm(algorithm)
    if groups.size == 1:
        algorithm = "ring"  # without CP every algorithm is the local kernel
    check_heads(algorithm, q.shape[2], k.shape[2], groups.ulysses_size if algorithm == "hybrid" else groups.size)
    if plan is None:
        plan = build_cp_plan(algorithm, groups, layout, causal, q.shape[1], document_ids, position_ids)
    if spec is None:
        spec = make_spec(q, k, algorithm, layout, causal, softmax_scale, backend, head_chunks, deterministic,
                         overlap, plan)
    if algorithm == "ring":
        out, lse = ring_attention(q, k, v, groups.cp if groups.size > 1 else None, spec,
                                  None if plan is None else plan.ring)
    elif algorithm == "allgather":
        out, lse = allgather_attention(q, k, v, groups.cp, spec, plan)
    else:
        out, lse = ulysses_attention(q, k, v, groups, spec, plan)
    return (out, lse) if return_lse else out
