"""Context-parallel attention: one entry point for every CP algorithm (ring, all-gather, Ulysses, hybrid).

``context_parallel_attention(q, k, v, group, layout, causal, ...)`` is the validating public API: it takes
this rank's slice of the sequence, ``[batch, local_seqlen, heads, head_dim]`` in the CP ``layout``
(``layout.py``), checks it, builds the batch's ``CPPlan`` (``build_cp_plan``; or takes ``plan=``, built once
for all layers) and the call's frozen ``AttentionSpec`` (``spec.build_spec``), and returns this rank's output
slice. ``attend`` is the internal entry behind it, for callers that validated once and hold a spec and a plan
already (the model's layers): no checks; ``spec.algorithm`` (a ``CPAlgorithm``, ``algorithms/``) gives the
autograd Function that runs it, and one rank runs the local kernel. ``group`` is the CP process group, or
``CPGroups`` with the Ulysses and ring subgroups for ``hybrid``. A sliding ``window`` lives in the plan (its
mask predicate); learned ``sinks`` ``[H]`` go to the algorithm's Function (``sinks.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.algorithms.registry import CPAlgorithm, get_cp_algorithm
from cp_train.parallel.cp.layout import check_layout_name
from cp_train.parallel.cp.plan.batch_plan import CPPlan, plan_batch
from cp_train.parallel.cp.plan.window_plan import Window, as_window
from cp_train.parallel.cp.ring.attention import ring_call
from cp_train.parallel.cp.sinks import check_sinks
from cp_train.parallel.cp.spec import AttentionSpec, build_spec
from cp_train.parallel.mesh.model_parallel import CPGroups

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, world: int) -> None:
    """Raise ``ValueError`` saying what to change when q/k/v cannot go through context parallelism."""
    check_layout_name(layout)
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


def build_cp_plan(group: dist.ProcessGroup | CPGroups | None, layout: str, causal: bool, local_len: int,
                  document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  algorithm: str | CPAlgorithm = "ring", window: int | tuple[int, int] | Window | None = None
                  ) -> CPPlan | None:
    """This batch's plan (``plan.batch_plan``): what every rank computes at every step, from the documents and
    positions of all CP ranks (one all-gather when ``document_ids`` are given). Build it once per batch and
    pass it to every layer of one ``window`` (an int W: W keys including the query, HF's ``sliding_window``;
    flash-attn's ``(left, right)``; None: unbounded; ``window_plan.as_window``); None: one document per sample
    at one rank without a window (the plain local kernel)."""
    groups = as_groups(group)
    return plan_batch(get_cp_algorithm(algorithm), groups, layout, causal, local_len, document_ids, position_ids,
                      as_window(window, causal))


def attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: CPGroups, spec: AttentionSpec,
                   plan: CPPlan | None, sinks: torch.Tensor | None = None
                   ) -> tuple[type[torch.autograd.Function], tuple]:
    """The autograd Function that computes ``spec.algorithm``'s attention, and its ``apply`` arguments (the k and
    v among them are repeated along heads where Ulysses needs it). One rank runs the local kernel: the ring's
    Function without a ring, over the plan's local calls."""
    if groups.size == 1:
        return ring_call(q, k, v, None, spec, None if plan is None else plan.ring, sinks)
    return spec.algorithm.call(q, k, v, groups, spec, plan, sinks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: CPGroups, spec: AttentionSpec,
           plan: CPPlan | None, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of inputs that were validated once, with the call's ``spec`` and the batch's ``plan``
    prebuilt (the window is the plan's), ``sinks`` ``[H]`` or None. No
    checks: the caller vouches for the shapes."""
    function, args = attention_call(q, k, v, groups, spec, plan, sinks)
    return function.apply(*args)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | CPGroups | None, layout: str = "zigzag",
                               causal: bool = True, softmax_scale: float | None = None, backend: str | None = None,
                               head_chunks: int | None = None, return_lse: bool = False,
                               deterministic: bool | None = None, overlap: bool | None = None,
                               document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                               plan: CPPlan | None = None, algorithm: str | CPAlgorithm = "ring",
                               window: int | tuple[int, int] | Window | None = None,
                               sinks: torch.Tensor | None = None):
    """Exact attention of this rank's q on the whole sequence's k/v, over the CP group.

    q [B, n, H, D]; k, v [B, n, Hk, D] (GQA when Hk < H), all in ``layout``. ``group`` None (or a
    group of one) means no context parallelism: the local kernel on this sequence. Returns out
    [B, n, H, D] in q's dtype (and lse [B, H, n] fp32 if ``return_lse``). ``algorithm``: a name (ring,
    allgather, ulysses, hybrid or one registered: ``algorithms/registry.py``; hybrid needs ``CPGroups``) or a
    ``CPAlgorithm``. ``backend`` picks
    the kernel (``cp_train.parallel.kernels.select``); ``deterministic`` (None:
    ``torch.are_deterministic_algorithms_enabled()``) asks for deterministic backwards; ``head_chunks`` and
    ``overlap`` tune the ring (defaults: ``spec.default_head_chunks`` for the backward and one chunk for the
    forward; ``head_chunks`` given applies both ways; ``spec.default_overlap``). The mask is said one of two
    ways: ``document_ids`` [B, n] (non-decreasing along each sample) keep attention inside each document and
    ``position_ids`` order tokens within one (default: the layout's; needed by the ``balanced`` layout), or
    ``plan``, the batch's ``build_cp_plan`` of the same group, layout, causality and algorithm, made once for
    many calls. ``window``: an int W (query i sees keys i-W+1 .. i of its document: HF's ``sliding_window``;
    not causal: i-W+1 .. i+W-1) or flash-attn's ``(left, right)`` (-1 unbounded); it goes into the plan, so
    a ``plan`` built with ``build_cp_plan(..., window=W)`` carries it (a different ``window`` here is an
    error). ``sinks``: learned per-query-head logits ``[H]`` (fp32 or q's dtype, differentiable; each rank's
    gradient is its rows' share, summed over CP by the trainer's gradient reduction), applied once after the
    merge (``sinks.py``).
    """
    groups = as_groups(group)
    check_inputs(q, k, v, layout, groups.size)
    if plan is not None and (document_ids is not None or position_ids is not None):
        raise ValueError("pass the mask one way: plan= (from build_cp_plan) or document_ids/position_ids, "
                         "not both")
    algorithm = get_cp_algorithm(algorithm)
    if plan is not None and plan.algorithm != algorithm and len(plan.areas) > 1:  # one rank's plan: any algorithm
        raise ValueError(f"plan= was built for the {plan.algorithm} algorithm but the call runs {algorithm}: "
                         f"build it with build_cp_plan(..., algorithm={algorithm.name!r})")
    algorithm.check_heads(q.shape[2], k.shape[2], groups.size, groups.ulysses_size)
    check_sinks(sinks, q.shape[2], q.dtype)
    window = as_window(window, causal)
    if plan is not None and window is not None and plan.window != window:
        raise ValueError(f"plan= was built for window {plan.window} but the call asks for {window}: build it with "
                         "build_cp_plan(..., window=...) of the same window")
    if plan is None:
        plan = plan_batch(algorithm, groups, layout, causal, q.shape[1], document_ids, position_ids, window)
    spec = build_spec(q.device, q.dtype, q.shape[0], q.shape[2], k.shape[2], q.shape[-1], algorithm=algorithm,
                      layout=layout, causal=causal, softmax_scale=softmax_scale, backend=backend,
                      head_chunks=head_chunks, deterministic=deterministic, overlap=overlap, plan=plan)
    out, lse = attend(q, k, v, groups, spec, plan, sinks)
    return (out, lse) if return_lse else out
