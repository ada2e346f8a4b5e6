"""Hugging Face Llama test cases: random transformers models built in code (test side) and the rank-side
checks that load them into sharded ``GPTModel``s, run them and gather the results (spawned gloo worlds).

The reference is always transformers' own ``LlamaForCausalLM`` in fp32; nothing comes from the hub.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import load_llama, save_llama
from cp_train.model.shards import local_tensor
from cp_train.parallel.cp.layout import gather_sequence, shard_sequence
from cp_train.parallel.mesh.state import ParallelState
from tests import trainer_cases

ORIGINAL_CONTEXT = 32  # the context the scaled models were "trained" at; the tests run 4x that
SEQ = 4 * ORIGINAL_CONTEXT
BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "initializer_range": 0.1, "max_position_embeddings": SEQ, "eos_token_id": 2, "bos_token_id": 1}
SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT},
}
VARIANTS = {  # name -> LlamaConfig overrides: every scaling, GQA and not, tied and untied heads
    "none gqa untied": {"rope_scaling": SCALINGS["none"]},
    "linear mha tied": {"rope_scaling": SCALINGS["linear"], "num_key_value_heads": 4, "tie_word_embeddings": True},
    "llama3 gqa tied": {"rope_scaling": SCALINGS["llama3"], "tie_word_embeddings": True},
    "yarn gqa untied": {"rope_scaling": SCALINGS["yarn"]},
    "yarn mscale gqa untied": {"rope_theta": 500000.0, "rope_scaling": {
        **SCALINGS["yarn"], "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False}},
}
TRAINER_SHAPE = {"vocab_size": trainer_cases.VOCAB, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 64, "eos_token_id": trainer_cases.EOD}  # = trainer_cases.TINY_MODEL


def make_hf_llama(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
                  **overrides: Any) -> Any:
    """A random ``LlamaForCausalLM`` (norm weights random too) saved to ``path``; returns the fp32 model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(path, **kwargs)
    return model.float()


def hf_reference(model: Any, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' logits ``[B, S, V]`` and mean loss (labels = the tokens, shifted inside)."""
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
    return {"logits": out.logits, "loss": out.loss}


def next_token_labels(tokens: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return labels


def tp_gather_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def full_logits_and_loss(model: GPTModel, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits ``[B, S, V]`` (gathered over TP and CP) and the mean next-token loss of the global ``tokens``."""
    cp, rank, layout = model.parallel.cp_size, model.parallel.cp_rank, model.parallel.layout
    local = shard_sequence(tokens, rank, cp, layout)
    labels = shard_sequence(next_token_labels(tokens), rank, cp, layout)
    with torch.no_grad():
        logits = tp_gather_last(model(local), model.parallel.tp_group)
        losses = model(local, labels=labels)
    if cp > 1:
        logits = gather_sequence(logits, model.parallel.cp.cp, layout)
        losses = gather_sequence(losses, model.parallel.cp.cp, layout)
    count = (next_token_labels(tokens) != -100).sum()
    return {"logits": logits, "loss": losses.double().sum() / count}


@contextmanager
def counting_reads() -> Iterator[list[int]]:
    """Count the weight elements ``WeightFiles.read_blocks`` copies (``read_block`` is one of them; ``[count]``,
    updated in place)."""
    from cp_train.model.hf import weights as hf_weights

    read = [0]
    original = hf_weights.WeightFiles.read_blocks

    def counting(self: Any, name: str, shape: Any, blocks: Any) -> None:
        blocks = list(blocks)
        read[0] += sum(out.numel() for out, _ in blocks)
        original(self, name, shape, blocks)

    hf_weights.WeightFiles.read_blocks = counting  # type: ignore[method-assign]
    try:
        yield read
    finally:
        hf_weights.WeightFiles.read_blocks = original  # type: ignore[method-assign]


def logits_on_rank(state: ParallelState, paths: dict[str, str], tokens: torch.Tensor) -> dict[str, Any]:
    """Per model directory: the loaded model's full logits and loss at this layout (zigzag CP), and whether
    this rank read exactly as many weight elements as its parameters hold (its TP shard, nothing more)."""
    results = {}
    with counting_reads() as read:
        for name, path in paths.items():
            read[0] = 0
            model = load_llama(path, state.model_parallel("zigzag"))
            held = sum(p.numel() for p in model.parameters())
            results[name] = {**full_logits_and_loss(model, tokens), "read": read[0], "held": held}
    return results


def round_trip_on_rank(state: ParallelState, source: str, target: str) -> None:
    """Load ``source`` at this layout and save it to ``target`` (collective; global rank 0 writes)."""
    model = load_llama(source, state.model_parallel("zigzag"))
    save_llama(model, target, max_shard_bytes=40_000)
    dist.barrier()


def train_from_hf_on_rank(state: ParallelState, corpus: str, run_dir: str, overrides: dict[str, Any],
                          tokens: torch.Tensor, save_to: str | None = None) -> dict[str, Any]:
    """The tiny trainer run with ``overrides`` (``checkpoint.init_from_hf`` among them): its full parameters at
    the start, its messages and losses, the trained model's full logits on ``tokens``, and how many weight
    elements this rank read from the HF files and holds (its TP and FSDP shards). ``save_to``: also write the
    trained model there with ``save_llama`` (collective)."""
    with counting_reads() as read:
        trainer = trainer_cases.Trainer(trainer_cases.tiny_config(corpus, run_dir, state.dims, **overrides), state)
    held = sum(local_tensor(p).numel() for p in trainer.model.parameters())
    start = trainer_cases.full_state(trainer, "params")
    result = trainer.train()
    if save_to is not None:
        save_llama(trainer.model, save_to)
    trainer.model.eval()
    return {"start": start if state.rank == 0 else {}, "messages": result.messages, "losses": result.losses,
            "logits": full_logits_and_loss(trainer.model, tokens)["logits"], "read": read[0], "held": held}
