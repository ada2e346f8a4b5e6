"""Ulysses (Megatron's ``a2a``, DeepSpeed-Ulysses): an all-to-all turns each rank's sequence shard of all heads
into the whole sequence of ``1 / cp`` of the heads, every rank attends that, and an all-to-all turns the output
back (``parallel/cp/ulysses/``). With packed documents, documents wholly on one rank stay home (attended there
with all heads) and only the rows of documents that cross ranks travel."""

from __future__ import annotations

from typing import Any

import torch

from cp_train.parallel.cp.algorithms.costs import (
    ACC,
    AttentionStep,
    Collective,
    Shapes,
    calls_of,
    expanded,
)
from cp_train.parallel.cp.algorithms.registry import BUILT_IN, CPAlgorithm, register_cp_algorithm
from cp_train.parallel.cp.plan.batch_plan import CPPlan, check_sorted, rank_order, ring_rank_plan, tokens_of
from cp_train.parallel.cp.plan.ulysses_plan import ulysses_documents_plan
from cp_train.parallel.cp.ulysses.attention import ulysses_call


def ulysses_collectives(heads: int, kv_heads: int, d: int, compute: int, n: int, degree: int,
                        group: str) -> list[Collective]:
    """The all-to-alls over ``degree`` ranks (per sample): q, k, v in (kv heads repeated up to the degree when
    fewer), the output and its fp32 lse back; the backward sends the output's gradient in and dq, dk, dv back."""
    sent_kv = max(kv_heads, degree)
    qkv = (heads + 2 * sent_kv) * d * compute * n
    out = heads * d * compute * n
    return [Collective("ulysses q/k/v", "all_to_all", group, qkv, 1, "forward"),
            Collective("ulysses out", "all_to_all", group, out, 1, "forward"),
            Collective("ulysses lse", "all_to_all", group, heads * ACC * n, 1, "forward"),
            Collective("ulysses d_out", "all_to_all", group, out, 1, "backward"),
            Collective("ulysses dq/dk/dv", "all_to_all", group, qkv, 1, "backward")]


def ulysses_kept(s: Shapes) -> int:
    """Its sequence-ordered q, k, v, output and lse for ``heads / u`` heads of the group's ``u * n`` tokens."""
    return s.n * (2 * s.heads + 2 * s.ulysses_kv_heads) * s.head_dim * s.compute + s.n * s.heads * ACC


def ulysses_buffers(s: Shapes, backward: bool, ring: Any = None) -> int:
    """The all-to-alls' send and receive buffers and their re-ordered copies for the head chunk at hand and the
    next, and the returning outputs (gradients in the backward) of every head chunk, held until the last one
    lands; kv heads repeated up to the group size when fewer. ``ring(s, rows, heads, kv_heads, backward)``: the
    buffers of a ring over the group's ``u * n`` tokens (hybrid)."""
    u, d, c = s.ulysses, s.head_dim, s.compute
    kv = s.ulysses_kv_heads
    chunks = max(k for k in range(1, 3) if s.heads % (k * u) == 0 and kv % (k * u) == 0)
    part = s.n * (s.heads + 2 * kv) // chunks * d * c  # one head chunk of q, k, v (either side of the all-to-all)
    rows, heads, kv_heads = u * s.n, s.heads // (u * chunks), kv // (u * chunks)
    ring_bytes = ring(s, rows, heads, kv_heads, backward) if ring is not None else 0
    kernel = expanded(s, rows, heads, kv_heads, backward)
    if not backward:  # q, k, v of this chunk (sent, received, re-ordered) and the next in flight; outputs returning
        return 5 * part + 2 * s.n * s.heads * (d * c + ACC) + max(kernel, ring_bytes)
    # dq, dk, dv (repeated kv heads) and every chunk's returning gradients (sent and received): at the last chunk's
    # kernel call, the earlier chunks' and that chunk's dout, kernel gradients and their copies; after it, all
    grads = s.n * (s.heads + 2 * kv) * d * c
    dout = s.n * s.heads // chunks * d * c
    at_kernel = grads * (1 + 2 * (chunks - 1) // chunks) + dout + part + max(kernel, ring_bytes)
    return max(at_kernel, 3 * grads + dout + 2 * part)


def cross_rows(plan: CPPlan, local_len: int, u: int) -> int:
    """Rows the all-to-all brings this rank: every other rank's (the busiest rank's cross rows with documents)."""
    if plan.documents is not None:
        counts = plan.documents.counts
        return sum(counts) - min(counts)
    return (u - 1) * local_len


class Ulysses(CPAlgorithm):
    def head_degree(self, cp: int, ulysses_size: int) -> int:
        return cp

    def ring_size(self, cp: int, ulysses_size: int) -> int:
        return 1

    def plan(self, tokens: Any, rank: int, ulysses: int, causal: bool, window: Any) -> CPPlan:
        """Home documents stay; the cross rows, ``1 / world`` of the heads, block by block where they land."""
        order, inverse = rank_order(tokens, range(tokens.keys.shape[0]))
        check_sorted(tokens.keys)
        documents, areas, calls = ulysses_documents_plan(tokens.keys, tokens.docs, tokens.span, rank, causal,
                                                         tokens.packed, window)
        return CPPlan(self, None, order, tokens.packed, areas, calls, documents, inverse=inverse, window=window)

    def one_document(self, plan: CPPlan, world: int, local_len: int, causal: bool, window: Any) -> CPPlan:
        """One document: the plain causal kernel on the sequence; with a window, one rank's plan of the sequence
        in order."""
        if window is None:
            return CPPlan(self, None, plan.order, plan.packed, plan.areas, 1, inverse=plan.inverse)
        sequence = torch.arange(local_len * world)[None]
        whole, _ = ring_rank_plan(tokens_of(torch.zeros_like(sequence)[None], sequence[None]), 0, causal, window)
        return CPPlan(self, whole, plan.order, plan.packed, plan.areas, whole.max_calls, inverse=plan.inverse,
                      window=window)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Any, spec: Any, plan: CPPlan | None,
             sinks: torch.Tensor | None) -> tuple[type[torch.autograd.Function], tuple]:
        return ulysses_call(q, k, v, groups.cp, None, spec, plan, sinks)

    def kv_rows_received(self, plan: CPPlan, local_len: int) -> int:
        return cross_rows(plan, local_len, len(plan.areas))

    def kv_head_share(self, plan: CPPlan) -> int:
        return len(plan.areas)

    def kept_bytes(self, s: Shapes) -> int:
        return ulysses_kept(s)

    def buffer_bytes(self, s: Shapes, backward: bool) -> int:
        return ulysses_buffers(s, backward)

    def attention_work(self, work: Any) -> tuple[list[list[Any]], int, list[Any]]:
        """Each rank attends the whole sequence with ``heads / cp`` heads; with documents its home documents with
        all its heads (here: each call ``cp`` times at ``heads / cp``) and every rank's block of cross queries
        against the cross keys, only the cross rows taking the all-to-alls (sized by the busiest rank)."""
        heads, cp = work.heads, work.cp
        collectives = ulysses_collectives(heads, work.kv_heads, work.head_dim, work.compute, work.n, cp, "cp")
        if not work.documents:
            return [[AttentionStep(work.whole, 0, 0)]] * cp, heads // cp, collectives
        plans, _, _ = work.plans(1)
        everyone = []
        for plan in plans:
            documents = plan.documents
            home = calls_of(documents.home) * cp if documents.home is not None else ()
            everyone.append([AttentionStep(home + tuple(c for block in documents.blocks for c in calls_of(block)),
                                           0, 0)])
        rows = max(plans[0].documents.counts)
        return everyone, heads // cp, ulysses_collectives(heads, work.kv_heads, work.head_dim, work.compute, rows,
                                                          cp, "cp")


register_cp_algorithm("ulysses", Ulysses(), BUILT_IN["ulysses"])
