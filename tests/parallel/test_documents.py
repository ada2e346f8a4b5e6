"""Per-document attention through every CP layout (spawned gloo worlds): exact, bf16, and no wasted work.

Documents differ between the two rows of the batch; the edge cases are one document, one-token
documents, boundaries on chunk and rank boundaries, one document over every rank and documents
shorter than a chunk (``tests/document_cases.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cp_train.parallel.cp.dropins_varlen import zigzag_ring_flash_attn_varlen_func
from cp_train.parallel.cp.layout import LAYOUTS
from tests import document_cases
from tests.document_cases import SPECS, documents, layout_positions

TOL = 1e-5
SEQLEN = {1: 16, 2: 32, 3: 48, 4: 64, 8: 128}  # divisible by 2*cp (zigzag)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_documents_fp32_match_float64(spawn_world, world: int, layout: str) -> None:
    cases = [(layout, causal, heads, kv_heads, spec)
             for causal, (heads, kv_heads), spec in itertools.product((True, False), ((4, 4), (4, 2)), SPECS)]
    worst = spawn_world(world).run(document_cases.check_cases, cases, SEQLEN[world])
    for case, error in zip(cases, worst[0], strict=True):
        assert error <= TOL, f"{case}: {error:.2e}"
    assert worst[0] == worst[-1], "ranks disagree"


def test_documents_at_cp8(spawn_world) -> None:
    cases = [(layout, True, 4, 2, spec) for layout in LAYOUTS for spec in ("random", "short")]
    worst = spawn_world(8).run(document_cases.check_cases, cases, SEQLEN[8])[0]
    assert max(worst) <= TOL, dict(zip(cases, worst, strict=True))


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (4, "balanced"), (4, "stripe")])
def test_documents_bf16_within_twice_the_local_kernel(spawn_world, world: int, layout: str) -> None:
    errors = spawn_world(world).run(document_cases.check_bf16, layout, 16 * world)[0]
    for name, (ring, local) in errors.items():
        assert ring <= 2.0 * local, f"{name}: ring bf16 error {ring:.2e} vs local kernel {local:.2e}"


def _expected_work(layout: str, causal: bool, seqlen: int, spec: str, world: int) -> list[dict[str, int]]:
    """Brute force from the dense mask: per rank the query-key pairs it must compute, and the bytes of K/V
    rows later ranks need and of dK/dV rows earlier ranks touched."""
    docs = documents(spec, 2, seqlen, world, seed=3)
    visible = docs[:, :, None] == docs[:, None, :]  # [B, query position, key position]
    if causal:
        visible &= torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    held = [layout_positions(layout, docs, r, world) for r in range(world)]  # [B, n] each
    row_bytes = 2 * 8 * 4 * 2  # kv heads * head_dim * fp32, for k and v (or dk and dv)

    def rows_used(source: int, hops: range) -> int:
        """Rows of ``source``'s block that the ranks ``hops`` after it see."""
        total = 0
        for b in range(2):
            if len(hops):
                queries = torch.cat([held[(source + h) % world][b] for h in hops])
                total += int(visible[b][queries][:, held[source][b]].any(0).sum())
        return total

    expected = []
    for rank in range(world):
        area = sum(int(visible[b][held[rank][b]].sum()) for b in range(2)) * 2  # two head chunks
        kv_bytes = grad_bytes = 0
        for step in range(world):
            source = (rank - step) % world
            kv_bytes += 2 * rows_used(source, range(step + 1, world)) * row_bytes  # forward and backward hops
            grad_bytes += rows_used(source, range(1, step + 1)) * row_bytes
        expected.append({"area": area, "kv_bytes": kv_bytes, "grad_bytes": grad_bytes})
    return expected


@pytest.mark.parametrize("layout,causal,spec", [("zigzag", True, "random"), ("contiguous", True, "random"),
                                                ("stripe", True, "short"), ("balanced", True, "random"),
                                                ("zigzag", False, "spanning"), ("zigzag", True, "one")])
def test_skipping_is_real(spawn_world, layout: str, causal: bool, spec: str) -> None:
    """Kernels compute exactly the visible query-key pairs (no masked tile), K/V hops carry exactly the rows
    later ranks use and dK/dV hops exactly the rows earlier ranks touched."""
    world, seqlen = 4, 64
    got = spawn_world(world).run(document_cases.count_work, layout, causal, seqlen, spec)
    for rank, (mine, expected) in enumerate(zip(got, _expected_work(layout, causal, seqlen, spec, world),
                                                strict=True)):
        assert mine["area"] == expected["area"], (rank, mine, expected)
        assert mine["kv_bytes"] == expected["kv_bytes"], (rank, mine, expected)
        assert mine["grad_bytes"] == expected["grad_bytes"], (rank, mine, expected)
        # two head chunks asked for: both ways, except the backward's local step (every head at once)
        local, remote = mine["local_calls"], mine["remote_calls"]
        assert mine["forward"] == 2 * (local + remote) and mine["backward"] == local + 2 * remote and local > 0


@pytest.mark.parametrize("layout,spec", [("zigzag", "random"), ("contiguous", "short"), ("balanced", "random")])
def test_allgather_sends_only_rows_used(spawn_world, layout: str, spec: str) -> None:
    """With packed documents the all-gather carries each rank only the rows of other blocks it uses (K/V in
    the forward and again in the backward, dK/dV back), and computes exactly the visible pairs."""
    world, seqlen = 4, 64
    docs = documents(spec, 2, seqlen, world, seed=3)
    visible = (docs[:, :, None] == docs[:, None, :]) & torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    held = [layout_positions(layout, docs, r, world) for r in range(world)]
    row_bytes = 2 * 8 * 4 * 2  # kv heads * head_dim * fp32, for k and v (or dk and dv)

    def used(by: int, of: int) -> int:  # rows of rank ``of``'s block that rank ``by``'s queries see
        return sum(int(visible[b][held[by][b]][:, held[of][b]].any(0).sum()) for b in range(2))

    got = spawn_world(world).run(document_cases.count_work, layout, True, seqlen, spec, "allgather")
    for rank, mine in enumerate(got):
        sent = sum(used(other, rank) for other in range(world) if other != rank)
        received = sum(used(rank, other) for other in range(world) if other != rank)
        assert mine["all_to_all"] == (2 * sent + received) * row_bytes, (rank, mine)
        assert mine["all_gather"] == 0
        assert mine["area"] == sum(int(visible[b][held[rank][b]].sum()) for b in range(2)) * 2


@pytest.mark.parametrize("layout,spec", [("zigzag", "random"), ("contiguous", "short"), ("balanced", "random")])
def test_ulysses_sends_only_cross_rows(spawn_world, layout: str, spec: str) -> None:
    """Ulysses with packed documents: a document wholly on one rank stays there; the all-to-alls carry only
    the cross rows (every row whose document lies on several ranks is one), to their heads' owners and back."""
    world = 4
    got = spawn_world(world).run(document_cases.count_ulysses, layout, 64, spec)
    counts = got[0]["counts"]
    assert all(mine["counts"] == counts for mine in got), "ranks disagree on the plan"
    row_bytes = 8 * 4  # one head (of 4 q heads, 2 kv heads repeated to 4, over 4 ranks) x head_dim 8 x fp32
    for rank, mine in enumerate(got):
        mine_rows, others = counts[rank] * mine["samples"], (sum(counts) - counts[rank]) * mine["samples"]
        assert mine["spanning"] <= mine_rows  # documents on several ranks always travel
        forward = 3 * (world - 1) * mine_rows * row_bytes + others * (row_bytes + 4)  # q, k, v out; out, lse back
        backward = (world - 1) * mine_rows * row_bytes + 3 * others * row_bytes  # dout out; dq, dk, dv back
        assert mine["all_to_all"] == forward + backward, (rank, mine)
    assert sum(counts) < 2 * 64, "no document stayed home"
    assert any(mine["home"] for mine in got)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_drop_ins_match_float64(spawn_world, world: int, zigzag: bool, causal: bool) -> None:
    lengths = [2 * world * n for n in (3, 1, 5, 2)]  # multiples of 2*cp, one as short as possible
    errors = spawn_world(world).run(document_cases.check_varlen, zigzag, causal, lengths)
    assert max(max(e.values()) for e in errors) <= TOL, errors[0]


def test_varlen_zigzag_needs_documents_of_2cp_tokens() -> None:
    q = torch.randn(7, 2, 8)
    with pytest.raises(ValueError, match=r"document 1 has 3 local tokens .*multiple of 2\*cp = 2"):
        zigzag_ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 4, 7], dtype=torch.int32), 4, causal=True)
    with pytest.raises(ValueError, match=r"cu_seqlens must be the local offsets \[0, \.\.\., 7\]"):
        zigzag_ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 4, 8], dtype=torch.int32), 4)
