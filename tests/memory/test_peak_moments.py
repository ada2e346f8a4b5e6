"""What exists at the moments of the peak (``cp_train/memory/phases.py``), measured in live tensor bytes: the
gradients the backward has made when a step has one micro-batch and no DDP buckets (the trainer frees them at
each step's start), one chunk of the fused head's logits at a time in its forward, and eager rope's casts of the
tables."""

from __future__ import annotations

import pytest
import torch

from bench import dry_run_check
from bench.tensor_bytes import LiveTensorBytes
from cp_train.parallel.mesh.state import ParallelDims
from cp_train.parallel.tp.fused_loss import linear_cross_entropy
from tests import trainer_cases


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def test_one_micro_batch_holds_only_the_gradients_the_backward_made(spawn_world, corpus, tmp_path) -> None:
    """At cp 1 without DDP a step of one micro-batch peaks (the head's backward) before the blocks' gradients
    exist; a step of two holds every gradient from the first. The peaks differ by those gradients, planned and
    measured (within 10%; 2% on this machine), and each plan is within 10% of its run."""
    records = {}
    for batch in (2, 4):  # two tokens' rows per micro-batch: one micro-batch a step, then two
        config = trainer_cases.tiny_config(corpus, str(tmp_path / str(batch)), ParallelDims(tp=1, cp=1, dp=1),
                                           **{"train.global_batch_size": batch})
        records[batch] = dry_run_check.compare(spawn_world(1), config, str(batch))
    change = {kind: records[4][kind] - records[2][kind] for kind in ("planned", "measured")}
    assert change["planned"] > 0 and abs(change["planned"] / change["measured"] - 1) <= 0.1, (change, records)
    assert all(abs(record["ratio"] - 1) <= 0.1 for record in records.values()), records


def test_the_fused_head_holds_one_chunk_of_logits_at_a_time() -> None:
    """The head and loss fused by chunks (``fused_loss.py``): its forward frees each chunk's fp32 logits before the
    next chunk's matmul, so it never holds two (64 tokens in chunks of 16, vocab 512 against hidden 8: the logits
    are all that count)."""
    x = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(512, 8, requires_grad=True)
    targets = torch.randint(0, 512, (64,))
    chunk_logits = 16 * 512 * 4
    tracker = LiveTensorBytes()
    tracker.track([x, weight, targets])
    with tracker:
        tracker.new_phase("forward")
        start = tracker.current
        loss = linear_cross_entropy(x, weight, targets, chunk_tokens=16)
        tracker.new_phase("end")
    assert chunk_logits <= tracker.peaks["forward"] - start < 1.5 * chunk_logits, (tracker.peaks, start)
    loss.sum().backward()  # and its gradients still flow
    assert x.grad is not None and weight.grad is not None


def test_eager_rope_keeps_its_casts_of_the_tables_as_planned() -> None:
    """Eager, ``apply_rope`` casts cos and sin to q's and k's dtype and its products keep the casts: two of each
    table per block in bf16 (``activations.rope_copies``; none in fp32, where the tables are shared)."""
    from cp_train.memory.activations import rope_copies
    from cp_train.model.rope import apply_rope, rope_tables
    from cp_train.parallel.cp.algorithms.costs import Shapes

    n, head_dim = 1024, 64
    cos, sin = rope_tables(torch.arange(n)[None], head_dim, 10000.0)
    for dtype, compute in ((torch.bfloat16, 2), (torch.float32, 4)):
        q = torch.randn(1, n, 4, head_dim, dtype=dtype, requires_grad=True)
        k = torch.randn(1, n, 2, head_dim, dtype=dtype, requires_grad=True)
        tracker = LiveTensorBytes()
        tracker.track([cos, sin, q, k])
        with tracker:
            start = tracker.current
            outputs = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kept = tracker.current - start - sum(out.untyped_storage().nbytes() for out in outputs)
        assert kept == rope_copies(Shapes(n, 256, 4, 2, head_dim, 512, 128, compute, 4)), (dtype, kept)
