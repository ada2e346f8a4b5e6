"""Hybrid (Megatron's ``a2a+p2p``, USP): Ulysses inside groups of ``ulysses_size`` adjacent CP ranks (its
all-to-alls on NVLink), the ring across those groups on their tokens in sequence order. It needs ``CPGroups``'
Ulysses and ring subgroups."""

from __future__ import annotations

from typing import Any

import torch

from cp_train.parallel.cp.algorithms.costs import Shapes, plan_steps
from cp_train.parallel.cp.algorithms.registry import BUILT_IN, CPAlgorithm, register_cp_algorithm
from cp_train.parallel.cp.algorithms.ring import ring_buffers, ring_rows_received
from cp_train.parallel.cp.algorithms.ulysses import (
    cross_rows,
    ulysses_buffers,
    ulysses_collectives,
    ulysses_kept,
)
from cp_train.parallel.cp.plan.batch_plan import CPPlan, gathered_rows, rank_order
from cp_train.parallel.cp.plan.rank_plan import build_plan
from cp_train.parallel.cp.ulysses.attention import ulysses_call


class Hybrid(CPAlgorithm):
    subgroups = True

    def head_degree(self, cp: int, ulysses_size: int) -> int:
        return ulysses_size

    def ring_size(self, cp: int, ulysses_size: int) -> int:
        return cp // ulysses_size

    def check(self, cp: int, ulysses_size: int) -> None:
        if not 1 < ulysses_size < cp:
            raise ValueError(f"parallel.cp_algorithm=hybrid needs 1 < parallel.ulysses_size < parallel.cp, got "
                             f"ulysses_size {ulysses_size} at cp {cp}: use cp_algorithm=ulysses for ulysses_size = "
                             f"cp, ring for 1")

    def plan(self, tokens: Any, rank: int, ulysses: int, causal: bool, window: Any) -> CPPlan:
        """The ring across the Ulysses groups, on each group's tokens in sequence order (1 / ulysses of the heads)."""
        start = rank - rank % ulysses
        order, inverse = rank_order(tokens, range(start, start + ulysses))
        groups = [range(g * ulysses, (g + 1) * ulysses) for g in range(tokens.keys.shape[0] // ulysses)]
        keys = torch.stack([torch.sort(gathered_rows(tokens.keys, tokens, g).flatten()).values for g in groups])
        ring = build_plan(keys, keys // tokens.span, tokens.span, rank // ulysses, causal, tokens.packed, window)
        areas = tuple(area // ulysses for area in ring.areas for _ in range(ulysses))
        return CPPlan(self, ring, order, tokens.packed, areas, ring.max_calls, inverse=inverse, window=window)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Any, spec: Any, plan: CPPlan | None,
             sinks: torch.Tensor | None) -> tuple[type[torch.autograd.Function], tuple]:
        return ulysses_call(q, k, v, groups.ulysses, groups.ring, spec, plan, sinks)

    def kv_rows_received(self, plan: CPPlan, local_len: int) -> int:
        return cross_rows(plan, local_len, self.kv_head_share(plan)) + ring_rows_received(plan)

    def kv_head_share(self, plan: CPPlan) -> int:
        return len(plan.areas) // max(1, plan.ring.world)

    def kept_bytes(self, s: Shapes) -> int:
        return ulysses_kept(s)

    def buffer_bytes(self, s: Shapes, backward: bool) -> int:
        return ulysses_buffers(s, backward, ring_buffers)

    def attention_work(self, work: Any) -> tuple[list[list[Any]], int, list[Any]]:
        u = work.ulysses_size
        plans, scale, small = work.plans(u)
        heads, kv_heads = work.heads // u, max(1, work.kv_heads // u)
        steps = plan_steps(plans, scale, small, heads, kv_heads, work.head_dim, work.compute, gathered=False)
        return steps, heads, ulysses_collectives(work.heads, work.kv_heads, work.head_dim, work.compute, work.n, u,
                                                 "ulysses")


register_cp_algorithm("hybrid", Hybrid(), BUILT_IN["hybrid"])
