"""The GPT model is the same model in every (tp, cp) layout and CP sequence layout (4 spawned gloo ranks).

Logits (gathered over TP vocab and CP sequence), per-token losses and gradients (TP shards
concatenated, summed over CP) must match the unsharded fp32 model within 1e-5 relative, and
the initial parameters must be identical.
"""

from __future__ import annotations

import pytest

from cp_train.parallel.mesh.state import run_with_parallel
from tests import model_cases

TOL = 1e-5
WORLD = 4
VARIANTS = {  # config overrides checked on top of the base model, per (tp, cp)
    (1, 1): [{}],
    (1, 2): [{}],
    (2, 1): [{}, {"tie_embeddings": True}],
    (2, 2): [{}, {"tie_embeddings": True}, {"mlp_chunks": 2}, {"mlp_chunks": 4},
             {"activation_checkpointing": True, "mlp_chunks": 2}, {"positions": True}],
    (1, 4): [{}, {"positions": True}, {"mlp_chunks": 4}],
}


def _worst_over_ranks(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    worst: dict[str, dict] = {}
    for errors in per_rank:
        for case, errs in errors.items():
            current = worst.setdefault(case, errs)
            if max(errs["logits"], errs["losses"], errs["grads"]) > max(current["logits"], current["losses"],
                                                                        current["grads"]):
                worst[case] = errs
    return worst


@pytest.mark.parametrize("tp,cp", list(VARIANTS))
def test_layouts_match_unsharded_model(spawn_world, tp: int, cp: int) -> None:
    per_rank = spawn_world(WORLD).run(run_with_parallel, (tp, cp, None), model_cases.check_layouts_on_rank,
                                      VARIANTS[(tp, cp)])
    worst = _worst_over_ranks(per_rank)
    assert len(worst) == 3 * len(VARIANTS[(tp, cp)]), "every attention layout x variant must be checked"
    failures = {case: e for case, e in worst.items() if max(e["logits"], e["losses"], e["grads"]) > TOL}
    assert not failures, f"(tp={tp}, cp={cp}) relative errors above {TOL}: {failures}"


def test_local_positions_break_cp_and_bad_sequences_raise(spawn_world) -> None:
    """Negative control (the comparison catches wrong RoPE positions) and the zigzag length errors."""
    world = spawn_world(WORLD)
    errors = world.run(run_with_parallel, (1, 4, None), model_cases.wrong_positions_error_on_rank)
    assert all(e["logits"] > 1e-3 for e in errors), f"local positions went unnoticed: {errors}"
    messages = world.run(run_with_parallel, (2, 2, None), model_cases.bad_sequence_messages_on_rank)
    for rank_messages in messages:
        assert len(rank_messages) == 2, rank_messages
        assert "sequence length 2 is shorter than 2*cp = 4 for the zigzag layout" in rank_messages[0]
        assert "sequence length 6 is not divisible by 2*cp = 4 for the zigzag layout" in rank_messages[1]


@pytest.mark.parametrize("tp,cp", [(1, 1), (1, 2), (2, 2), (1, 4)])
def test_packed_documents_equal_each_document_alone(spawn_world, tp: int, cp: int) -> None:
    """With document_ids, a packed sample's per-token losses are those of its documents run one by one."""
    for reset in (True, False):
        for layout in ("zigzag", "stripe"):
            errors = spawn_world(WORLD).run(run_with_parallel, (tp, cp, None), model_cases.packed_documents_on_rank,
                                            reset, layout)
            assert max(errors) <= TOL, f"reset_positions={reset} {layout}: {errors}"
    if (tp, cp) == (1, 2):  # negative control: without the documents attention crosses them
        errors = spawn_world(WORLD).run(run_with_parallel, (tp, cp, None), model_cases.packed_documents_on_rank,
                                        False, "zigzag", False)
        assert min(errors) > 1e-3, errors


@pytest.mark.parametrize("sizes,algorithm", [((2, 2, 1), "allgather"), ((2, 2, 1), "ulysses"),
                                             ((1, 4, 1, 2), "hybrid"), ((1, 4, 1), "ulysses")])
def test_cp_algorithms_match_unsharded_model(spawn_world, sizes: tuple, algorithm: str) -> None:
    errors = spawn_world(WORLD).run(run_with_parallel, sizes, model_cases.check_algorithm_on_rank, algorithm)
    assert max(max(e.values()) for e in errors) <= TOL, errors
