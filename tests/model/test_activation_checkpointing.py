"""``model.activation_checkpointing``: none, selective (all but the CP attention recomputed) and full.

On the tiny model at cp 1 (the CP attention operator is the same at any cp): selective gives bitwise the
losses and gradients of none; the attention operator runs once per layer per step under none and selective
and twice under full; what the forward keeps for the backward (the bytes autograd packs outside the
checkpoints) falls from none to selective to full.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.model import GPTModel
from cp_train.parallel.cp import op
from tests.model_cases import global_batch, tiny_config

MODES = ("none", "selective", "full")


def _run(mode: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    model = GPTModel(tiny_config(activation_checkpointing=mode, mlp_chunks=2))
    data = global_batch(model.config)
    calls = []
    original = op.attention_call
    monkeypatch.setattr(op, "attention_call", lambda *args: calls.append(1) or original(*args))
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = model(data["tokens"], labels=data["labels"])
    (losses * data["weights"]).sum().backward()
    return {"losses": losses.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "attention_calls": len(calls), "kept": sum(kept), "layers": model.config.num_layers}


def test_selective_equals_none_bitwise_and_keeps_less_than_none(monkeypatch) -> None:
    runs = {mode: _run(mode, monkeypatch) for mode in MODES}
    none, selective, full = (runs[m] for m in MODES)
    assert torch.equal(selective["losses"], none["losses"])
    assert all(torch.equal(selective["grads"][n], g) for n, g in none["grads"].items())
    layers = none["layers"]
    assert none["attention_calls"] == selective["attention_calls"] == layers, runs
    assert full["attention_calls"] == 2 * layers  # the recompute runs the CP attention again
    assert none["kept"] > selective["kept"] > full["kept"], {m: r["kept"] for m, r in runs.items()}


def test_old_booleans_and_bad_modes() -> None:
    assert tiny_config(activation_checkpointing=True).activation_checkpointing == "full"
    assert tiny_config(activation_checkpointing=False).activation_checkpointing == "none"
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, selective, full"):
        GPTModel(tiny_config(activation_checkpointing="some"))
