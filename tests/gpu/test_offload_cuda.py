"""Activation offload on CUDA (``parallel/offload.py`` with ``parallel/host_copies.py``'s side stream): the copies
are pinned host memory, every block but the last moves its tensors out and gets them back ahead of its backward,
and the losses and gradients are those without offload (fp32: the same kernels on the same values; a copy read
before it was written, or memory reused under a copy, would show as a large error).
"""

from __future__ import annotations

import pytest
import torch

from cp_train.model import GPTModel
from cp_train.parallel import offload
from tests.model_cases import global_batch, tiny_config
from tests.numerics import rel_err

CONFIG = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128, "max_position_embeddings": 512,
          "num_layers": 4}


def _step(model: GPTModel, data: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[offload.OffloadStats]]:
    documents = torch.zeros_like(data["tokens"])
    documents[:, data["tokens"].shape[1] // 3:] = 1  # two documents: the varlen path too
    with offload.observe() as seen:
        losses = model(data["tokens"], labels=data["labels"], document_ids=documents)
        (losses * data["weights"]).sum().backward()
    torch.cuda.synchronize()
    return losses.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}, seen


@pytest.mark.parametrize(("checkpointing", "mode", "chunks"), [
    ("selective", "checkpointed", 1), ("full", "checkpointed", 1), ("none", "all", 2)])
def test_offload_on_cuda_trains_as_without(monkeypatch, checkpointing: str, mode: str, chunks: int) -> None:
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)
    base = tiny_config(**CONFIG, activation_checkpointing=checkpointing, mlp_chunks=chunks)
    data = {name: x.cuda() for name, x in global_batch(base, seq=384).items()}
    torch.manual_seed(0)
    reference = GPTModel(base, device="cuda")
    losses, grads, _ = _step(reference, data)
    model = GPTModel(tiny_config(**CONFIG, activation_checkpointing=checkpointing, mlp_chunks=chunks,
                                 activation_offload=mode), device="cuda")
    model.load_state_dict(reference.state_dict())
    pinned: list[bool] = []
    copy_out = offload.ActivationOffload._copy_out

    def recording(self, layer: int, t: torch.Tensor, sources: list):  # noqa: ANN001, ANN202
        copy = copy_out(self, layer, t, sources)
        pinned.append(copy.host.is_pinned())
        return copy

    monkeypatch.setattr(offload.ActivationOffload, "_copy_out", recording)
    got, got_grads, seen = _step(model, data)
    assert rel_err(got, losses) < 1e-6
    for name, grad in grads.items():
        assert rel_err(got_grads[name], grad) < 1e-5, name
    stats = seen[0]
    assert stats.offloaded > 0 and stats.fetched == stats.offloaded and stats.fetched_late == 0, stats
    assert pinned and all(pinned), "the host copies are pinned memory"
    assert stats.peak_layers <= 1 + offload.PREFETCH_LAYERS, stats
