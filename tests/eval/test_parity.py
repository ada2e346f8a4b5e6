"""Trained parity (issue 33, test 3): a tiny 2-layer GPT (a sliding-window layer, then a full one, both with
learned sinks) trains 20 AdamW steps in fp64 on retrieval data: a key after a marker somewhere in random
filler, asked for again at the end. The eval's scoring then reads it (loss by position over packed documents,
passkey-style exact match and key log-probability). The per-step losses and the eval outputs at cp 4 (zigzag,
contiguous, ulysses, allgather) equal cp 1's to 1e-10.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cp_train.eval.scoring import EvalGroups, LocalBatch, answer_scores, local_index, position_sums
from cp_train.model.config import ModelConfig
from cp_train.model.gpt import GPTModel
from cp_train.parallel.mesh.state import run_with_parallel

TINY = {"vocab_size": 64, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden_size": 64, "max_position_embeddings": 32, "seed": 7,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "attention_sinks": True}
SEQ, BATCH, STEPS, MARKER, KEYS = 32, 2, 20, 1, 2
VARIANTS = [("zigzag", "ring"), ("contiguous", "ring"), ("zigzag", "ulysses"), ("zigzag", "allgather")]
TOL = 1e-10


def retrieval_tokens(seed: int, batch: int = BATCH) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``[batch, SEQ]`` samples: random filler, ``MARKER k1 k2`` at a random place, ``MARKER k1 k2`` at the end;
    and each sample's answer span (the final key)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, TINY["vocab_size"], (batch, SEQ), generator=gen)
    for row in range(batch):
        key = torch.randint(2, 10, (KEYS,), generator=gen)
        at = int(torch.randint(0, SEQ - 2 * (KEYS + 1), (1,), generator=gen))
        tokens[row, at] = tokens[row, SEQ - KEYS - 1] = MARKER
        tokens[row, at + 1:at + 1 + KEYS] = tokens[row, SEQ - KEYS:] = key
    return tokens, [(SEQ - KEYS, SEQ)] * batch


def packed_batch(seed: int) -> dict[str, torch.Tensor]:
    """A held-out batch of three packed documents per sample, as the loader gives it (``[BATCH, SEQ]``)."""
    tokens, _ = retrieval_tokens(seed)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    documents = torch.zeros_like(tokens)
    documents[:, 10:] += 1
    documents[:, 22:] += 1
    return {"tokens": tokens, "labels": labels, "loss_mask": (labels >= 0).double(),
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ), "document_ids": documents}


def train_and_evaluate(state: Any, layout: str, algorithm: str) -> dict[str, Any]:
    """20 AdamW steps (fp64) on this parallel state (None: one process), then the eval's scores."""
    config = ModelConfig(**TINY)
    if state is None:
        model, groups = GPTModel(config, dtype=torch.float64), EvalGroups()
    else:
        model = GPTModel(config, state.model_parallel(layout, algorithm), dtype=torch.float64)
        groups = EvalGroups(model.parallel.attention_layout, cp=state.cp.group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    forward = lambda b: model(b.tokens, b.position_ids, labels=b.labels, document_ids=b.document_ids)  # noqa: E731
    losses = []
    for step in range(STEPS):
        tokens, _ = retrieval_tokens(100 + step)
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = -100
        index = local_index(torch.zeros_like(tokens), groups)
        token_losses = forward(LocalBatch(torch.gather(tokens, 1, index), index, None, torch.gather(labels, 1, index)))
        count = BATCH * (SEQ - 1)
        (token_losses.sum() / count).backward()
        total = groups.reduce(token_losses.detach().sum(), "cp")
        for param in model.parameters():  # every parameter is replicated over CP: its gradient is the sum
            groups.reduce(param.grad, "cp")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total) / count)
    model.eval()
    sums = groups.reduce(position_sums(forward, packed_batch(7), groups, document_mask=True), "cp")
    tokens, spans = retrieval_tokens(8, batch=4)
    exact, logprob = answer_scores(forward, tokens, spans, groups)
    return {"losses": losses, "buckets": sums.tolist(), "exact": exact.tolist(), "logprob": logprob.tolist()}


def run_variants(state: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {variant: train_and_evaluate(state, *variant) for variant in VARIANTS}


def _worst(got: dict[str, Any], ref: dict[str, Any]) -> float:
    worst = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    worst = max(worst, float((torch.tensor(got["buckets"]) - torch.tensor(ref["buckets"])).abs().max()))
    return max(worst, float((torch.tensor(got["logprob"]) - torch.tensor(ref["logprob"])).abs().max()))


def test_trained_parity_cp4_equals_cp1(spawn_world) -> None:
    assert not dist.is_initialized() or dist.get_world_size() == 1
    ref = train_and_evaluate(None, "contiguous", "ring")
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]  # it trains
    results = spawn_world(4).run(run_with_parallel, (1, 4, 1), run_variants)
    for rank_results in results:
        for variant, got in rank_results.items():
            assert got["exact"] == ref["exact"], (variant, got["exact"], ref["exact"])
            assert _worst(got, ref) <= TOL, (variant, _worst(got, ref))
