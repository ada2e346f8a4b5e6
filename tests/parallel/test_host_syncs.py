"""No host sync in the model's forward and backward: every CP algorithm, with packed documents, at cp 2 (and
hybrid at cp 4 with Ulysses 2), on one spawned world of 4 gloo ranks.

On a GPU a device-to-host read (``item``, ``tolist``, ``bool``/``float``/``int``/``index`` of a tensor,
``nonzero``) stalls the CPU until the device catches up. On CPU nothing stalls, so the test counts the calls
instead: the tensor methods are wrapped with counters for the forward and backward of ``GPTModel`` with a
prebuilt CP plan (as the trainer calls it; the plan is built by the loader, before the step) and every count
must be zero. A deliberate call of each kind is counted once, so the counters cannot silently stop counting.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cp_train.model import GPTModel
from cp_train.parallel.cp.layout import sequence_positions, shard_sequence
from cp_train.parallel.cp.plan.batch_plan import CPPlan, plan_from_gathered
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel
from tests.model_cases import BATCH, SEQ, tiny_config

WORLD = 4
METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero")


@contextlib.contextmanager
def counting_syncs() -> Iterator[Counter[str]]:
    """Inside: every call of ``METHODS`` on a tensor and of ``torch.nonzero`` adds one to the Counter yielded."""
    counts: Counter[str] = Counter()
    saved: dict[str, Any] = {name: torch.Tensor.__dict__.get(name) for name in METHODS}
    original_nonzero = torch.nonzero

    def counted(name: str, method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return method(*args, **kwargs)
        return wrapper

    for name in METHODS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    torch.nonzero = counted("torch.nonzero", original_nonzero)
    try:
        yield counts
    finally:
        torch.nonzero = original_nonzero
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def _counters_count() -> dict[str, int]:
    """One deliberate call of each kind: every counter must read 1."""
    x = torch.ones(2)
    with counting_syncs() as counts:
        x[0].item()
        x.tolist()
        bool(x[0])
        float(x[0])
        int(x[0])
        [0, 1][x[0].long()]
        x.nonzero()
        torch.nonzero(x)
    return dict(counts)


def _packed_batch(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Tokens, labels, loss mask, documents (different in each sample: a packed plan) and positions restarting
    at each document, all ``[BATCH, SEQ]``."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(BATCH, SEQ, generator=gen) < 0.15
    starts[:, 0] = False
    first = torch.cummax(torch.where(starts, torch.arange(SEQ), 0), dim=1).values
    return {"tokens": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
            "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
            "loss_mask": (torch.rand(BATCH, SEQ, generator=gen) < 0.9).float(),
            "docs": torch.cumsum(starts.long(), 1), "positions": torch.arange(SEQ) - first}


def syncs_on_rank(state: ParallelState, algorithms: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Per case (algorithm, with or without documents): the host syncs counted in one forward and backward
    of the model with a prebuilt plan, this rank's slice; and ``"counters"``, the deliberate calls."""
    config = tiny_config()
    result = {"counters": _counters_count()}
    data = _packed_batch(config.vocab_size, seed=4)
    for algorithm in algorithms:
        model = GPTModel(config, state.model_parallel("zigzag", algorithm))
        local = {name: shard_sequence(x, state.cp.rank, state.cp.size, "zigzag") for name, x in data.items()}
        for documents in (True, False):
            docs = local["docs"] if documents else None
            positions = local["positions"] if documents else None
            plan = model.build_cp_plan(local["tokens"].shape[1], docs, positions)  # the loader's work
            model.zero_grad(set_to_none=True)
            with counting_syncs() as counts:
                losses = model(local["tokens"], positions, labels=local["labels"], document_ids=docs, plan=plan)
                ((losses * local["loss_mask"]).sum() / 100.0).backward()
            assert all(p.grad is not None for p in model.parameters())
            result[f"{algorithm} documents={documents}"] = dict(counts)
    return result


def test_no_host_sync_in_forward_and_backward(spawn_world) -> None:
    world = spawn_world(WORLD)
    cp2 = world.run(run_with_parallel, (1, 2, 2), syncs_on_rank, ("ring", "allgather", "ulysses"))
    hybrid = world.run(run_with_parallel, (1, 4, 1, 2), syncs_on_rank, ("hybrid",))
    for rank, found in enumerate([*cp2, *hybrid]):
        counters = found.pop("counters")
        assert counters == {name: 1 for name in (*METHODS, "torch.nonzero")}, counters
        assert found and all(not counts for counts in found.values()), (rank % WORLD, found)
    assert len(cp2[0]) == 6 and len(hybrid[0]) == 2


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor a plan holds (its cache aside): index selectors, varlen calls, routes, order, cross rows."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [x for f in dataclasses.fields(value) if f.name != "cache" for x in _tensors(getattr(value, f.name))]
    if isinstance(value, tuple):
        return [x for item in value for x in _tensors(item)]
    return []


@pytest.mark.parametrize("algorithm,ulysses", [("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)])
def test_the_plan_moves_every_index_tensor_at_once(monkeypatch, algorithm: str, ulysses: int) -> None:
    """``CPPlan.pin_memory`` (the loader's, with varlen calls built) and ``CPPlan.to`` (the trainer's) reach every
    index tensor of every algorithm's plan; on the CPU ``to`` is the plan itself."""
    world, batch, n = 4, 2, 16
    positions = torch.stack([sequence_positions(n * world, r, world, "zigzag") for r in range(world)])[:, None]
    positions = positions.expand(world, batch, n).contiguous()
    docs = torch.stack([torch.bucketize(positions[:, b].contiguous(), torch.tensor(bounds))
                        for b, bounds in enumerate(([5, 20, 23, 40, 51], [9, 30, 33, 60]))], dim=1)
    plan: CPPlan = plan_from_gathered(algorithm, world, 1, ulysses, True, docs, positions)
    assert plan.packed and _tensors(plan) and plan.to("cpu") is plan
    pinned: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda x: pinned.append(x) or x.clone(), raising=True)
    held = plan.pin_memory()
    assert held.device.type == "cpu" and len(pinned) == len(_tensors(held)) >= len(_tensors(plan))
    moved = held.to("meta", non_blocking=True)
    assert moved.device.type == "meta" and moved.to("meta") is moved
    assert len(_tensors(moved)) == len(_tensors(held)) and all(x.device.type == "meta" for x in _tensors(moved))
    assert all(x.device.type == "cpu" for x in _tensors(plan) + _tensors(held))
