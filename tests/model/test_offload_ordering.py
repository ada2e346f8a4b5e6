"""Activation offload's CUDA ordering rules (``parallel/host_copies.py``), checked on the CPU with a stand-in
``Copier`` that logs every copy, event and wait, and whose copies never finish on their own (a GPU far behind its
host): a saved tensor's memory is released only after the compute stream waited for the copy that reads it; at most
``MAX_LAYERS_IN_FLIGHT`` layers' sources are pending beyond the running layer, none after the last offloaded one; every
fetched copy is waited for before it is read, or before it is freed unread; and the model trains bitwise as without
offload through this path.
"""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from cp_train.model import GPTModel, block
from cp_train.parallel import offload
from tests.model_cases import global_batch, tiny_config

LAYERS = 4


class LaggingCopier:
    """A ``Copier`` whose copies are plain clones, done only when ``finish`` says so; ``log`` holds
    ("out", source id), ("in", event), ("mark", event), ("wait", event) and ("free", source id) in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.events = 0
        self.finished = -1  # events up to this one are done
        self.sources: list[weakref.ref] = []
        self.alive_at_marks: list[int] = []  # sources alive as each event is recorded (a block's end, a fetch)

    def copy_out(self, source: torch.Tensor) -> torch.Tensor:
        assert is_non_overlapping_and_dense_or_false(source), "a copy out reads a dense tensor"
        ident = len(self.sources)
        storage = source.untyped_storage()
        self.sources.append(weakref.ref(storage))
        weakref.finalize(storage, self.log.append, ("free", ident))
        self.log.append(("out", ident))
        return source.detach().clone()

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, int]:
        event = self.mark()
        self.log.append(("in", event))
        return host.clone(), event

    def mark(self) -> int:
        self.events += 1
        self.log.append(("mark", self.events))
        self.alive_at_marks.append(self.alive())
        return self.events

    def wait(self, event: int) -> None:
        self.log.append(("wait", event))

    def done(self, event: int) -> bool:
        return event <= self.finished

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.sources)


@pytest.fixture
def copier(monkeypatch: pytest.MonkeyPatch) -> LaggingCopier:
    """Every forward's offload uses one ``LaggingCopier`` (every tensor offloaded, as in test_offload.py)."""
    stand_in = LaggingCopier()
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)
    monkeypatch.setattr(block, "ActivationOffload", functools.partial(offload.ActivationOffload, copier=stand_in))
    return stand_in


def _step(model: GPTModel, copier: LaggingCopier | None = None, after_forward: list | None = None):
    data = global_batch(model.config, seq=32)
    losses = model(data["tokens"], labels=data["labels"])
    if after_forward is not None:
        after_forward.append(copier.alive())
    (losses * data["weights"]).sum().backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(("checkpointing", "mode", "chunks"), [
    ("selective", "checkpointed", 1), ("none", "all", 2)])
def test_memory_is_released_only_after_the_compute_stream_waited_for_its_copy(
        copier, checkpointing, mode, chunks) -> None:
    config = {"num_layers": LAYERS, "activation_checkpointing": checkpointing, "mlp_chunks": chunks}
    torch.manual_seed(0)
    losses, grads = _step(GPTModel(tiny_config(**config)))
    torch.manual_seed(0)
    alive_after_forward: list[int] = []
    got, got_grads = _step(GPTModel(tiny_config(**config, activation_offload=mode)), copier, alive_after_forward)
    assert torch.equal(got, losses) and all(torch.equal(got_grads[n], g) for n, g in grads.items())

    log = copier.log
    outs = {ident: i for i, (kind, ident) in enumerate(log) if kind == "out"}
    marks = {event: i for i, (kind, event) in enumerate(log) if kind == "mark"}
    waits = [(i, event) for i, (kind, event) in enumerate(log) if kind == "wait"]
    frees = {ident: i for i, (kind, ident) in enumerate(log) if kind == "free"}
    assert outs and frees.keys() == outs.keys(), "every source is released by the end of the backward"
    for ident, freed in frees.items():  # a wait for an event marked after the copy, before the release
        assert any(outs[ident] < marks[event] < at < freed for at, event in waits), (ident, log)
    first_fetch = next(i for i, (kind, _) in enumerate(log) if kind == "in")
    assert max(frees.values()) < first_fetch, "every source is released when the backward starts, before a fetch"
    per_layer = len(outs) // (LAYERS - 1)
    assert max(copier.alive_at_marks) == (1 + offload.MAX_LAYERS_IN_FLIGHT) * per_layer, copier.alive_at_marks
    assert alive_after_forward == [0], "none pending after the last offloaded block (the head runs next)"
    for i, (kind, event) in enumerate(log):  # every fetched copy is waited for before it is read
        if kind == "in":
            assert ("wait", event) in log[i + 1:], (event, log)


def test_a_fetched_copy_freed_unread_is_waited_for_first(copier) -> None:
    run = offload.ActivationOffload(2, "cpu", keep_last=0, min_bytes=0, copier=copier)
    weight = torch.randn(8, 8, requires_grad=True)
    with run.layer(0, torch.nn.Module()):
        y = (torch.randn(4, 8) @ weight).sin()  # saves its input
    run._reach(1)  # the backward starts above layer 0: layer 0 is fetched ahead
    event = next(event for kind, event in copier.log if kind == "in")
    assert ("wait", event) not in copier.log
    del y, run  # the backward never ran (an error in it): the fetched copy goes unread
    assert ("wait", event) in copier.log


def test_a_saved_tensor_changed_in_place_inside_its_block_is_an_error(copier) -> None:
    run = offload.ActivationOffload(1, "cpu", keep_last=0, min_bytes=0, copier=copier)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="block 0 changed a tensor saved for its backward in place"):
        with run.layer(0, torch.nn.Module()):
            y = x * 2
            y.sin()  # saves y
            y.add_(1)
