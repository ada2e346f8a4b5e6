"""Single-process tests: the kernel interface against float64 math, and the CP layouts."""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.cp.layout import (
    STATIC_LAYOUTS,
    check_layout,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.spec import default_head_chunks, default_overlap
from cp_train.parallel.kernels.select import flash_backward, flash_forward
from tests.numerics import rel_err


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_torch_kernel_matches_math_reference(causal: bool, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 48, heads, 16, generator=gen)
    k, v = (torch.randn(2, 48, kv_heads, 16, generator=gen) for _ in range(2))
    dout = torch.randn(2, 48, heads, 16, generator=gen)
    out, lse = flash_forward(q, k, v, causal, backend="torch")
    ref_out, ref_lse = flash_forward(q, k, v, causal, backend="math")
    assert out.shape == q.shape and lse.shape == (2, heads, 48) and lse.dtype == torch.float32
    assert ref_out.dtype == torch.float64
    assert rel_err(out, ref_out) < 1e-6 and rel_err(lse, ref_lse) < 1e-6
    grads = flash_backward(dout, q, k, v, out, lse, causal, backend="torch")
    refs = flash_backward(dout, q, k, v, ref_out, ref_lse, causal, backend="math")
    for name, g, r in zip("qkv", grads, refs, strict=True):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < 1e-5, f"d{name}: {rel_err(g, r)}"


def test_explicit_scale_is_used() -> None:
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    out_a, lse_a = flash_forward(q, k, v, softmax_scale=0.5)
    out_b, lse_b = flash_forward(q * 0.5 * 8**0.5, k, v)
    assert rel_err(out_a, out_b) < 1e-5 and rel_err(lse_a, lse_b) < 1e-5


@pytest.mark.parametrize("layout", STATIC_LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout: str, world: int) -> None:
    seqlen = 2 * world * 5
    x = torch.arange(3 * seqlen).reshape(3, seqlen)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (3, seqlen // world) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    covered = torch.cat([sequence_positions(seqlen, r, world, layout) for r in range(world)])
    assert torch.equal(covered.sort().values, torch.arange(seqlen))
    for r in range(world):  # the positions say which tokens a shard holds
        assert torch.equal(shards[r][0], x[0, sequence_positions(seqlen, r, world, layout)])


def test_layout_positions_by_rule() -> None:
    assert sequence_positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    assert sequence_positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert sequence_positions(16, 1, 4, "stripe").tolist() == [1, 5, 9, 13]


def test_layout_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"not divisible by 2\*cp = 8 .*multiple of 8"):
        check_layout(20, 4, "zigzag")
    with pytest.raises(ValueError, match="not divisible by cp = 3"):
        check_layout(16, 3, "stripe")
    with pytest.raises(ValueError, match="unknown CP layout"):
        check_layout(16, 2, "spiral")
    with pytest.raises(ValueError, match="outside the CP group"):
        sequence_positions(16, 2, 2, "contiguous")


def test_cpu_ring_defaults_follow_threads_ranks_and_documents() -> None:
    """CPU head chunks leave every thread a (batch x query head) of the flash backward, one kv head per chunk
    at one thread; one chunk with one rank or many small document calls. The backward's hops wait in place on
    CPU with one document and are posted early with packed documents (and always on GPUs)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    ring = CPPlan("ring", None, None, False, areas=(1, 1), max_calls=2)
    documents = CPPlan("ring", None, None, True, areas=(1, 1), max_calls=9)
    alone = CPPlan("ring", None, None, False, areas=(1,), max_calls=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert default_head_chunks(cpu, 8, ring, 1) == 8 and default_head_chunks(cpu, 8, None, 1) == 8
        torch.set_num_threads(4)
        assert default_head_chunks(cpu, 8, ring, 1) == 2  # four kv heads (four query heads) per call
        assert default_head_chunks(cpu, 8, ring, 4) == 8  # GQA 4 (or batch 4): one kv head feeds four threads
        assert default_head_chunks(cpu, 2, ring, 1) == 1
        assert default_head_chunks(cpu, 8, documents, 1) == 1 and default_head_chunks(cpu, 8, alone, 1) == 1
    finally:
        torch.set_num_threads(threads)
    assert default_head_chunks(cuda, 8, ring) == 2
    assert not default_overlap(cpu, ring) and not default_overlap(cpu, None)
    assert default_overlap(cpu, documents) and default_overlap(cuda, ring)


def test_the_mask_is_said_one_way() -> None:
    """``context_parallel_attention`` takes a prebuilt plan or document ids, not both, and a plan of its algorithm
    only; one rank's plan is the local kernel's whatever algorithm was asked."""
    from cp_train.parallel.cp.attention import build_cp_plan, context_parallel_attention
    from cp_train.parallel.cp.plan.batch_plan import _static_plan

    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    plan = build_cp_plan(None, "contiguous", True, 8, docs, algorithm="ulysses")
    assert plan.algorithm.name == "ulysses" and plan.ring.world == 1  # the local kernel's calls, run by any algorithm
    expected = context_parallel_attention(q, q, q, None, "contiguous", document_ids=docs)
    assert torch.equal(context_parallel_attention(q, q, q, None, "contiguous", plan=plan), expected)
    with pytest.raises(ValueError, match="pass the mask one way: plan= .* or document_ids/position_ids, not both"):
        context_parallel_attention(q, q, q, None, "contiguous", plan=plan, document_ids=docs)
    ulysses = _static_plan("ulysses", "contiguous", True, 2, 1, 0, 8)
    with pytest.raises(ValueError, match=r"plan= was built for the ulysses algorithm but the call runs ring: "
                                         r"build it with build_cp_plan\(\.\.\., algorithm='ring'\)"):
        context_parallel_attention(q, q, q, None, "contiguous", plan=ulysses)
