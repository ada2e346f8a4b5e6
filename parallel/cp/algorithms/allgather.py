"""All-gather (Megatron's ``all_gather``, Llama 3's CP): every rank gathers the whole K/V in kv-head chunks and
attends its own queries block by block where they land; the backward reduce-scatters dK/dV
(``parallel/cp/allgather.py``). With packed documents only the rows some rank uses travel, by all-to-all."""

from __future__ import annotations

from typing import Any

import torch

from cp_train.parallel.cp.algorithms.costs import ACC, Shapes, expanded, fp32_grads, plan_steps
from cp_train.parallel.cp.algorithms.registry import BUILT_IN, CPAlgorithm, register_cp_algorithm
from cp_train.parallel.cp.allgather import allgather_call
from cp_train.parallel.cp.plan.batch_plan import CPPlan, check_sorted, work
from cp_train.parallel.cp.plan.rank_plan import gathered_plan


class AllGather(CPAlgorithm):
    gathers_kv = True

    def plan(self, tokens: Any, rank: int, ulysses: int, causal: bool, window: Any) -> CPPlan:
        """Every rank's block as it arrives, in rank order: nothing to reorder."""
        check_sorted(tokens.keys)
        areas, max_calls = work(tokens, torch.sort(tokens.keys.flatten()).values, causal, window)
        ring = gathered_plan(tokens.keys, tokens.docs, tokens.span, rank, causal, tokens.packed, areas, max_calls,
                             window)
        return CPPlan(self, ring, None, tokens.packed, areas, max_calls, window=window)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Any, spec: Any, plan: CPPlan | None,
             sinks: torch.Tensor | None) -> tuple[type[torch.autograd.Function], tuple]:
        return allgather_call(q, k, v, groups.cp, spec, plan, sinks)

    def kv_rows_received(self, plan: CPPlan, local_len: int) -> int:
        ring = plan.ring
        return 0 if ring is None or ring.world == 1 else sum(step.held_rows for step in ring.steps[1:])

    def buffer_bytes(self, s: Shapes, backward: bool) -> int:
        """A kv-head chunk's K/V of the whole sequence (``cp * n`` rows) with the next chunk's gather in flight; in
        the backward each chunk's fp32 dK/dV of the whole sequence, held with its reduce-scatter output until the
        last chunk's lands."""
        d, c, group, chunk = s.head_dim, s.compute, s.heads // s.kv_heads, s.kv_chunk
        gathered = 2 * 2 * s.cp * s.n * chunk * d * c  # this chunk's whole K/V and the next chunk's in flight
        held = expanded(s, s.n, group * chunk, chunk, backward) + s.n * (group + 2) * chunk * d * ACC
        if backward:  # every chunk's whole-sequence dK/dV and its reduce-scatter output
            gathered += 2 * s.cp * s.n * s.kv_heads * d * ACC + 2 * s.n * s.kv_heads * d * ACC
        return fp32_grads(s, backward) + gathered + held

    def attention_work(self, work: Any) -> tuple[list[list[Any]], int, list[Any]]:
        plans, scale, small = work.plans(1)
        return plan_steps(plans, scale, small, work.heads, work.kv_heads, work.head_dim, work.compute,
                          gathered=True), work.heads, []


register_cp_algorithm("allgather", AllGather(), BUILT_IN["allgather"])
