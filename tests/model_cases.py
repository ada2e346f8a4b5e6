"""Rank-side checks of the GPT model across (tp, cp) layouts, run inside spawned gloo worlds.

Every rank builds the same global batch from a seed and runs the unsharded model (no
groups, the whole sequence) as the reference; it then builds the model on its TP / CP
groups, runs its slice of the batch, gathers logits, losses and gradients back to full
shapes and returns relative errors against the reference (see test_model.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cp_train.model import GPTModel, ModelConfig
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, gather_sequence, shard_sequence
from cp_train.parallel.mesh.state import ParallelState
from tests.numerics import rel_err

TINY = {"vocab_size": 128, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden_size": 64, "max_position_embeddings": 64, "seed": 7}
SEQ, BATCH = 32, 2
Batch = dict[str, torch.Tensor]
Result = dict[str, Any]


def tiny_config(**overrides: Any) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def global_batch(config: ModelConfig, seq: int = SEQ, batch: int = BATCH, seed: int = 0) -> Batch:
    """Tokens, labels (a few ignored with -100), positions and per-token loss weights, all ``[batch, seq]``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(batch, seq, generator=gen) < 0.1] = -100
    return {"tokens": tokens[:, :-1].contiguous(), "labels": labels, "weights": torch.rand(batch, seq, generator=gen),
            "positions": torch.arange(seq).expand(batch, seq).contiguous()}


def step(model: GPTModel, data: Batch, positions: bool = False) -> Result:
    """Logits (no grad), per-token losses and the gradients of ``sum(weights * losses)``."""
    pos = data["positions"] if positions else None
    with torch.no_grad():
        logits = model(data["tokens"], pos)
    model.zero_grad(set_to_none=True)
    losses = model(data["tokens"], pos, labels=data["labels"])
    (losses * data["weights"]).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    return {"logits": logits, "losses": losses.detach(),
            "grads": {name: p.grad for name, p in model.named_parameters()},
            "params": {name: p.detach() for name, p in model.named_parameters()}}


def _tp_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _full_param(model: GPTModel, name: str, local: torch.Tensor, cp_sum: bool) -> torch.Tensor:
    """The full-shape tensor of parameter ``name`` from this rank's ``local`` (param or grad)."""
    if cp_sum:
        local = local.clone()
        dist.all_reduce(local, group=model.parallel.cp.cp)  # every parameter is replicated over CP
    param = model.get_parameter(name)
    if getattr(param, "tensor_model_parallel", False):
        return _tp_gather(local, model.parallel.tp_group, param.partition_dim)
    copies = _tp_gather(local.unsqueeze(0), model.parallel.tp_group, 0)
    assert all(rel_err(c, copies[0]) <= 1e-6 for c in copies), f"{name}: TP-replicated copies differ"
    return local


def gather_full(model: GPTModel, got: Result) -> Result:
    """``step`` results of a sharded model gathered to full shapes (grads summed over CP)."""
    layout, cp = model.parallel.layout, model.parallel.cp.cp
    logits = _tp_gather(got["logits"], model.parallel.tp_group, -1)
    return {"logits": gather_sequence(logits, cp, layout), "losses": gather_sequence(got["losses"], cp, layout),
            "grads": {n: _full_param(model, n, g, True) for n, g in got["grads"].items()},
            "params": {n: _full_param(model, n, p, False) for n, p in got["params"].items()}}


def compare(got: Result, ref: Result) -> dict[str, float]:
    """Relative errors of logits, losses and the worst gradient; parameters must be identical."""
    differing = [n for n, p in ref["params"].items() if not torch.equal(got["params"][n], p)]
    assert not differing, f"initial parameters differ from the unsharded model's: {differing}"
    grads = {n: rel_err(got["grads"][n], g) for n, g in ref["grads"].items()}
    worst = max(grads, key=grads.get)
    return {"logits": rel_err(got["logits"], ref["logits"]), "losses": rel_err(got["losses"], ref["losses"]),
            "grads": grads[worst], "worst_grad": worst}


def run_sharded(state: ParallelState, config: ModelConfig, data: Batch, layout: str, positions: bool = False,
                algorithm: str = "ring") -> Result:
    """``step`` on this rank's slice of ``data`` (CP ``layout``, attention ``algorithm``), gathered."""
    model = GPTModel(config, state.model_parallel(layout, algorithm))
    local = {k: shard_sequence(v, state.cp.rank, state.cp.size, layout) for k, v in data.items()}
    return gather_full(model, step(model, local, positions))


def check_layouts_on_rank(state: ParallelState, variants: list[dict[str, Any]]) -> dict[str, dict]:
    """Errors against the unsharded model for every attention layout x ``variants`` (config overrides).

    A variant may set ``positions=True``: the global position ids are passed in, sharded like
    the tokens, instead of being derived from the layout.
    """
    errors = {}
    for variant in variants:
        overrides = {k: v for k, v in variant.items() if k != "positions"}
        ref_config = tiny_config(**overrides)
        data = global_batch(ref_config)
        ref = step(GPTModel(ref_config), data)
        for layout in STATIC_LAYOUTS:
            got = run_sharded(state, ref_config, data, layout, variant.get("positions", False))
            errors[f"{layout} {variant}"] = compare(got, ref)
    return errors


def wrong_positions_error_on_rank(state: ParallelState) -> dict[str, float]:
    """Negative control: local instead of global positions must NOT match the reference."""
    config = tiny_config()
    data = global_batch(config)
    ref = step(GPTModel(config), data)
    model = GPTModel(config, state.model_parallel("zigzag"))
    local = {k: shard_sequence(v, state.cp.rank, state.cp.size, "zigzag") for k, v in data.items()}
    local["positions"] = torch.arange(SEQ // state.cp.size).expand(BATCH, -1)  # every rank "starts at 0"
    got = gather_full(model, step(model, local, positions=True))
    return {"logits": rel_err(got["logits"], ref["logits"])}


def bad_sequence_messages_on_rank(state: ParallelState) -> list[str]:
    """The errors a CP model raises (before any communication) for sequences the layout cannot split."""
    model = GPTModel(tiny_config(), state.model_parallel("zigzag"))
    messages = []
    for local_len in (1, 3):
        try:
            model(torch.zeros(1, local_len, dtype=torch.long))
        except ValueError as error:
            messages.append(str(error))
    return messages


def packed_documents_on_rank(state: ParallelState, reset_positions: bool, layout: str = "zigzag",
                             masked: bool = True) -> float:
    """Worst relative error between a packed batch's per-token losses (documents masked unless ``masked`` is
    False, this rank's (tp, cp) groups) and each document run alone through the unsharded model, with the
    same positions."""
    config = tiny_config()
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    starts = torch.rand(BATCH, SEQ, generator=gen) < 0.15
    starts[:, 0] = False
    docs = torch.cumsum(starts.long(), 1)
    first = torch.cummax(torch.where(starts, torch.arange(SEQ), 0), dim=1).values
    positions = torch.arange(SEQ) - first if reset_positions else torch.arange(SEQ).expand(BATCH, SEQ)
    alone = torch.empty(BATCH, SEQ)
    reference = GPTModel(config)
    with torch.no_grad():
        for b in range(BATCH):
            for doc in docs[b].unique():
                rows = (docs[b] == doc).nonzero().squeeze(1)
                alone[b, rows] = reference(tokens[b, rows][None], positions[b, rows][None], labels[b, rows][None])[0]
    model = GPTModel(config, state.model_parallel(layout))
    local = {name: shard_sequence(x, state.cp.rank, state.cp.size, layout)
             for name, x in (("tokens", tokens), ("labels", labels), ("docs", docs), ("positions", positions))}
    with torch.no_grad():
        losses = model(local["tokens"], local["positions"], local["labels"],
                       document_ids=local["docs"] if masked else None)
    return rel_err(gather_sequence(losses, state.cp.group, layout), alone)


def check_algorithm_on_rank(state: ParallelState, algorithm: str) -> dict[str, float]:
    """The model with ``algorithm`` CP attention against the unsharded model (zigzag and stripe layouts)."""
    config = tiny_config()
    data = global_batch(config)
    ref = step(GPTModel(config), data)
    return {layout: max(v for k, v in compare(run_sharded(state, config, data, layout, algorithm=algorithm),
                                              ref).items() if k != "worst_grad")
            for layout in ("zigzag", "stripe")}
