"""``model.activation_offload`` (``parallel/offload.py``): what the blocks save for the backward goes to host memory
during the forward and comes back one block ahead of the backward, with losses and gradients bitwise those without.

At cp 1 in one process (packed documents; selective, full, and no checkpointing with ``all``; compiled blocks); at
cp 2 with FSDP2, ring and Ulysses, documents, selective and full, and at tp 2 with sequence parallelism, through the
trainer in spawned gloo worlds (``tests/offload_cases.py``). Every tensor over 0 bytes is offloaded here
(``MIN_OFFLOAD_BYTES`` 0: the tiny model's tensors are a few KiB).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate
from cp_train.memory.dry_run import memory_plan
from cp_train.model import GPTModel
from cp_train.model.block import Block
from cp_train.parallel import offload
from cp_train.parallel.mesh.state import ParallelDims, run_with_parallel
from tests import offload_cases, trainer_cases
from tests.model_cases import global_batch, tiny_config

LAYERS = 4


@pytest.fixture
def every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def _documents(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """Packed documents: non-decreasing ids, a new document at ~1 in 6 tokens."""
    starts = torch.rand(batch, seq, generator=torch.Generator().manual_seed(seed)) < 1 / 6
    starts[:, 0] = False
    return starts.cumsum(1)


def _step(model: GPTModel, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
    data = global_batch(model.config, seed=seed)
    with offload.observe() as seen:
        losses = model(data["tokens"], labels=data["labels"], document_ids=_documents(*data["tokens"].shape))
        (losses * data["weights"]).sum().backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}, seen


@pytest.mark.parametrize(("checkpointing", "mode", "chunks"), [
    ("selective", "checkpointed", 1), ("full", "checkpointed", 2), ("none", "all", 1), ("none", "all", 2)])
def test_losses_and_gradients_are_bitwise_those_without_offload(every_tensor, checkpointing, mode, chunks) -> None:
    config = {"num_layers": LAYERS, "activation_checkpointing": checkpointing, "mlp_chunks": chunks}
    losses, grads, _ = _step(GPTModel(tiny_config(**config)))
    got, got_grads, seen = _step(GPTModel(tiny_config(**config, activation_offload=mode)))
    assert torch.equal(got, losses)
    assert all(torch.equal(got_grads[name], grad) for name, grad in grads.items())
    assert len(seen) == 1 and seen[0].offloaded > 0 and seen[0].fetched == seen[0].offloaded, seen


def test_the_forward_keeps_host_copies_and_the_backward_at_most_two_blocks(every_tensor, monkeypatch) -> None:
    """Selective checkpointing: every block but the last saves 11 tensors and offloads 6 (its input and the
    attention's q, k, v, output and lse; the input and the output are saved twice, copied once; the RoPE tables and
    the attention's ticket stay). After the forward no offloaded tensor is alive on the compute device and no copy
    is fetched; in the backward each block is fetched ahead of it, at most two blocks' copies alive at once."""
    config = tiny_config(num_layers=LAYERS, activation_checkpointing="selective")
    counted: list[int] = []
    plain_forward = Block.forward

    def counting_forward(self: Block, x: torch.Tensor, inputs) -> torch.Tensor:  # noqa: ANN001
        with torch.autograd.graph.saved_tensors_hooks(lambda t: counted.append(t.numel() > 0) or t, lambda t: t):
            return plain_forward(self, x, inputs)

    monkeypatch.setattr(Block, "forward", counting_forward)
    _step(GPTModel(config))  # what the blocks save without offload, counted by a plain hook around each
    monkeypatch.setattr(Block, "forward", plain_forward)

    copies, sources = [], []
    copy_out = offload.ActivationOffload._copy_out

    def recording_copy_out(self, layer: int, t: torch.Tensor, pending: list):  # noqa: ANN001, ANN202
        copy = copy_out(self, layer, t, pending)
        copies.append(copy)
        sources.append((weakref.ref(t.untyped_storage()), copy.host.untyped_storage().data_ptr()))
        return copy

    monkeypatch.setattr(offload.ActivationOffload, "_copy_out", recording_copy_out)
    model = GPTModel(tiny_config(num_layers=LAYERS, activation_checkpointing="selective",
                                 activation_offload="checkpointed"))
    data = global_batch(model.config)
    with offload.observe() as seen:
        losses = model(data["tokens"], labels=data["labels"])
        stats = seen[0]
        empty = len(counted) - sum(counted)  # torch 2.11's checkpoint saves an empty tensor per call: kept
        assert stats.packed == len(counted) and sum(counted) == 11 * LAYERS, (stats, counted)
        assert stats.offloaded == len(copies) == 6 * (LAYERS - 1), stats
        assert stats.kept == 3 * (LAYERS - 1) + 11 + empty, stats  # cos, sin and the ticket; the last block's 11
        assert all(copy.device is None and copy.host is not None for copy in copies)
        assert all(source() is None for source, _ in sources), "an offloaded tensor is still alive on the device"
        assert stats.fetched == 0
        (losses * data["weights"]).sum().backward()
    assert stats.fetched == stats.offloaded and stats.fetched_late == 0, stats  # every block prefetched
    assert stats.peak_layers == 1 + offload.PREFETCH_LAYERS == 2, stats
    per_block = stats.host_bytes // (LAYERS - 1)
    assert stats.peak_device_bytes <= 2 * per_block, stats
    assert all(copy.host is None and copy.device is None for copy in copies)  # released as they were read


def test_a_second_backward_through_one_forward_says_what_to_change(every_tensor) -> None:
    model = GPTModel(tiny_config(activation_checkpointing="full", activation_offload="checkpointed"))
    data = global_batch(model.config)
    loss = model(data["tokens"], labels=data["labels"]).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="read again after its backward released it .*activation_offload=none"):
        loss.backward()


def test_settings_that_do_not_go_together_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="activation_offload must be one of none, checkpointed, all, got 'host'"):
        GPTModel(tiny_config(activation_offload="host"))
    with pytest.raises(ValueError, match="activation_checkpointing is none: set it to selective or full, or offload"):
        GPTModel(tiny_config(activation_offload="checkpointed"))
    config = trainer_cases.tiny_config("corpus", "run", ParallelDims(tp=1, cp=1, dp=1),
                                       **{"model.activation_offload": "checkpointed"})
    with pytest.raises(ConfigError, match=r"^model: activation_offload checkpointed moves what activation "
                                          r"checkpointing keeps, and activation_checkpointing is none[^\n]*$"):
        validate(config, 1)


@pytest.mark.slow
def test_compiled_blocks_offload_bitwise(every_tensor) -> None:
    """``train.compile``: the hooks see what the compiled block saves (one compile, offload off then on)."""
    model = GPTModel(tiny_config(num_layers=3, activation_checkpointing="full", activation_offload="checkpointed"))
    model.compile_parts()
    for block in model.layers:
        block.offloads = False
    losses, grads, _ = _step(model)
    model.zero_grad(set_to_none=True)
    for block in model.layers:
        block.offloads = True
    got, got_grads, seen = _step(model)
    assert torch.equal(got, losses)
    assert all(torch.equal(got_grads[name], grad) for name, grad in grads.items())
    assert seen[0].offloaded == 2 and seen[0].fetched_late == 0, seen  # the two first blocks' inputs


CP2 = {f"{algorithm}-{checkpointing}": {"parallel.fsdp": True, "parallel.cp_algorithm": algorithm,
                                        "model.activation_checkpointing": checkpointing,
                                        "model.activation_offload": "checkpointed"}
       for algorithm in ("ring", "ulysses") for checkpointing in ("selective", "full")}


def test_fsdp_at_cp2_ring_and_ulysses_with_documents_train_bitwise(spawn_world, corpus, tmp_path) -> None:
    """One step of two micro-batches: per offloaded block, 6 copies under selective and 1 under full; the
    bytes moved per forward are the dry run's (``cp_train/memory/offload.py``, on CPU: no pinned rounding)."""
    for result in spawn_world(2).run(run_with_parallel, (1, 2, 1), offload_cases.offload_against_none, corpus,
                                     str(tmp_path), CP2):
        for name, got in result.items():
            assert got["same_losses"] and got["same_grads"], (name, got)
            per_block = 6 if name.endswith("selective") else 1
            assert got["forwards"] == 2, got  # one step of two micro-batches
            assert got["offloaded"] == got["fetched"] == 2 * (offload_cases.LAYERS - 1) * per_block, (name, got)
            assert got["fetched_late"] == 0 and got["peak_layers"] == 2, (name, got)
            config = trainer_cases.tiny_config(corpus, str(tmp_path), ParallelDims(tp=1, cp=2, dp=1), **CP2[name], **{
                "model.num_layers": offload_cases.LAYERS, "parallel.backend": "gloo"})
            planned = memory_plan(config, 2)[2]["offloaded"]
            assert got["host_bytes"] == got["forwards"] * planned, (name, got, planned)


def test_sequence_parallel_at_tp2_trains_bitwise(spawn_world, corpus, tmp_path) -> None:
    cases = {"tp2-sp-selective": {"model.activation_checkpointing": "selective", "model.activation_offload": "all"}}
    for result in spawn_world(2).run(run_with_parallel, (2, 1, 1), offload_cases.offload_against_none, corpus,
                                     str(tmp_path), cases):
        got = result["tp2-sp-selective"]
        assert got["same_losses"] and got["same_grads"] and got["offloaded"] > 0, got
