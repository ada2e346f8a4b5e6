"""Ulysses with documents: which documents stay home, the balance that choice keeps, and the plan's rows."""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.cp.plan.segments import pack_keys
from cp_train.parallel.cp.plan.ulysses_plan import TOLERANCE, document_work, home_documents, ulysses_documents_plan


def _random_docs(world: int, rows: int, mean: int, seed: int) -> torch.Tensor:
    """Dense document numbers ``[world, rows]`` of one sample cut contiguously over the ranks."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(world * rows, generator=gen) < 1.0 / mean
    starts[0] = False
    return torch.cumsum(starts.long(), 0).view(world, rows)


def _loads(docs: torch.Tensor, home: dict[int, int], causal: bool) -> tuple[list[int], int]:
    """Each rank's home work and the cross work."""
    numbers, counts = torch.unique(docs, return_counts=True)
    work = {int(d): document_work(int(c), causal) for d, c in zip(numbers, counts, strict=True)}
    loads = [sum(work[d] for d, r in home.items() if r == rank) for rank in range(docs.shape[0])]
    return loads, sum(work.values()) - sum(loads)


@pytest.mark.parametrize("world,mean,causal", [(2, 64, True), (4, 16, True), (4, 200, True), (8, 32, False),
                                               (3, 40, True)])
def test_home_documents_are_whole_and_keep_the_balance(world: int, mean: int, causal: bool) -> None:
    kept = 0
    for seed in range(5):
        docs = _random_docs(world, 256, mean, seed)
        home = home_documents(docs, causal)
        for d, rank in home.items():  # wholly on its rank
            assert bool((docs[rank] == d).any()) and all(not bool((docs[r] == d).any())
                                                         for r in range(world) if r != rank)
        loads, cross = _loads(docs, home, causal)
        total = sum(loads) + cross
        assert max(load * world + cross for load in loads) * TOLERANCE[1] <= total * TOLERANCE[0]
        kept += len(home)
    assert kept > 0


def test_every_whole_document_stays_when_balanced_and_spanning_ones_travel() -> None:
    docs = torch.tensor([[0, 0, 1, 1, 2, 2], [2, 2, 3, 3, 4, 4]])  # doc 2 spans; the ranks' home work is equal
    assert home_documents(docs, True) == {0: 0, 1: 0, 3: 1, 4: 1}
    lopsided = torch.tensor([[0, 0, 0, 0, 0, 1], [1, 2, 3, 4, 5, 6]])  # rank 0's document is most of the work
    assert 0 not in home_documents(lopsided, True)  # its 15 of 23 pairs are spread over the heads


def test_plan_rows_areas_and_self_coverage() -> None:
    world, rows = 4, 128
    docs = _random_docs(world, rows, 24, seed=7)
    positions = torch.arange(world * rows).view(world, rows)
    keys, span = pack_keys(docs, positions)
    plans = [ulysses_documents_plan(keys, docs, span, rank, True, False) for rank in range(world)]
    counts = plans[0][0].counts
    home = home_documents(docs, True)
    for rank, (plan, areas, calls) in enumerate(plans):
        assert plan.counts == counts and areas == plans[0][1] and calls == plans[0][2]
        stays = sum(int((docs[rank] == d).sum()) for d, r in home.items() if r == rank)
        assert counts[rank] == rows - stays
        home_rows = sum(s.rows for s in plan.home.steps[0].segments) if plan.home else 0
        assert home_rows == stays
        own = plan.blocks[rank].steps[0]
        assert own.source == rank and sum(s.rows for s in own.segments) == counts[rank]  # each row sees itself
    total = sum(document_work(int(c), True) for c in torch.unique(docs, return_counts=True)[1])
    assert total - world < sum(plans[0][1]) <= total
