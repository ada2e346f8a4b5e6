"""The ring (Megatron's ``p2p``): each rank keeps its queries while K/V blocks travel the CP ring, one hop per
step, each hop overlapped with the step's kernels (``parallel/cp/ring/``); the backward sends dK/dV around with
K/V. With a sliding window where a halo exchange moves fewer rows (zigzag), the rows each rank uses come straight
from their owners instead (the all-gather Function on the halo plan)."""

from __future__ import annotations

from typing import Any

import torch

from cp_train.parallel.cp.algorithms.costs import ACC, Shapes, expanded, fp32_grads, plan_steps
from cp_train.parallel.cp.algorithms.registry import BUILT_IN, CPAlgorithm, register_cp_algorithm
from cp_train.parallel.cp.allgather import allgather_call
from cp_train.parallel.cp.plan.batch_plan import CPPlan, ring_rank_plan
from cp_train.parallel.cp.ring.attention import ring_call


def ring_buffers(s: Shapes, rows: int, heads: int, kv_heads: int, backward: bool) -> int:
    """The transient bytes of a ring over ``rows`` query rows of ``heads`` / ``kv_heads`` (K/V blocks of
    ``rows`` rows): the block held, the next arriving and the copy sent, and in the backward the fp32 dK/dV
    accumulators travelling (one leaving, one arriving), per kv-head chunk."""
    d, c, group = s.head_dim, s.compute, heads // kv_heads
    chunk = min(s.kv_chunk, kv_heads)
    if not backward:  # one chunk: the block held and the next arriving, a step's output before its merge
        return 2 * 2 * rows * kv_heads * d * c + rows * heads * d * c + expanded(s, rows, heads, kv_heads, False)
    local = expanded(s, rows, heads, kv_heads, True) + 2 * rows * chunk * d * c
    remote = (3 * 2 * rows * chunk * d * c + 2 * 2 * rows * chunk * d * ACC + rows * (group + 2) * chunk * d * ACC
              + expanded(s, rows, group * chunk, chunk, True))
    return max(local, remote)


def ring_rows_received(plan: CPPlan) -> int:
    """K/V rows a rank receives over ``plan.ring``: the blocks relayed to it (a halo plan: the rows gathered)."""
    ring = plan.ring
    if ring is None or ring.world == 1:
        return 0
    if plan.halo:
        return sum(step.held_rows for step in ring.steps[1:])
    return sum(step.kv_rows[1] for step in ring.steps[:-1])


class Ring(CPAlgorithm):
    def plan(self, tokens: Any, rank: int, ulysses: int, causal: bool, window: Any) -> CPPlan:
        ring, halo = ring_rank_plan(tokens, rank, causal, window)
        return CPPlan(self, ring, None, tokens.packed, ring.areas, ring.max_calls, window=window, halo=halo)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Any, spec: Any, plan: CPPlan | None,
             sinks: torch.Tensor | None) -> tuple[type[torch.autograd.Function], tuple]:
        if plan is not None and plan.halo:
            return allgather_call(q, k, v, groups.cp, spec, plan, sinks)
        return ring_call(q, k, v, groups.cp, spec, None if plan is None else plan.ring, sinks)

    def kv_rows_received(self, plan: CPPlan, local_len: int) -> int:
        return ring_rows_received(plan)

    def buffer_bytes(self, s: Shapes, backward: bool) -> int:
        return fp32_grads(s, backward) + ring_buffers(s, s.n, s.heads, s.kv_heads, backward)

    def attention_work(self, work: Any) -> tuple[list[list[Any]], int, list[Any]]:
        plans, scale, small = work.plans(1)
        return plan_steps(plans, scale, small, work.heads, work.kv_heads, work.head_dim, work.compute,
                          gathered=False), work.heads, []


register_cp_algorithm("ring", Ring(), BUILT_IN["ring"])
