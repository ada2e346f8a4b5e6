"""The headline: the same training run in every (tp, cp, dp) layout (tiny fp32 GPT, gloo, spawned ranks).

6 steps (``trainer_cases.CURVE``) on the same global batches of EOD-masked data (CP ranks hold unequal numbers of loss
tokens), with document masks: the step-1 loss and gradients must match the unsharded (1, 1, 1) run
within 1e-6 relative and the loss curve within 1e-5, with DDP and with FSDP (there with one sample
per micro-batch, so every rank accumulates gradients over 2-4 micro-batches; also ZeRO-2, reducing after
every micro-batch (``parallel.fsdp_reduce: per_microbatch``), and with
activation checkpointing and a chunked MLP). A run with the
per-rank-mean loss reduction (the usual bug), and FSDP left to average its gradients, must fail the
same comparison. The FSDP runs' state bytes per rank fall as 1 / (dp x cp) and by tp, and a run built
in full before sharding trains bitwise like the meta-device build.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.memory import dry_run
from cp_train.parallel.mesh.state import ParallelDims, run_with_parallel
from tests import trainer_cases
from tests.numerics import rel_err

REFERENCE = (1, 1, 1)
# (tp, cp, dp[, variant]): the variants run another CP layout or algorithm (the others: zigzag, ring)
VARIANTS = {"balanced": {"parallel.cp_layout": "balanced"}, "allgather": {"parallel.cp_algorithm": "allgather"},
            "ulysses": {"parallel.cp_algorithm": "ulysses"},
            "hybrid": {"parallel.cp_algorithm": "hybrid", "parallel.ulysses_size": 2},
            "fsdp": (FSDP_ON := {"parallel.fsdp": True, "train.micro_batch_size": 1}),
            "fsdp-zero2": {**FSDP_ON, "parallel.fsdp_reshard_after_forward": False},
            "fsdp-per-microbatch": {**FSDP_ON, "parallel.fsdp_reduce": "per_microbatch"},
            "fsdp-ac": {**FSDP_ON, "model.activation_checkpointing": True, "model.mlp_chunks": 2},
            "fsdp-full-build": FSDP_ON}  # built in full, then sharded
# the variants that shard with FSDP (and are built on the meta device)
FSDP = ("fsdp", "fsdp-zero2", "fsdp-ac", "fsdp-per-microbatch")
LAYOUTS_BY_WORLD = {1: [REFERENCE], 2: [(1, 2, 1), (1, 2, 1, "balanced"), (1, 2, 1, "allgather"), (1, 2, 1, "ulysses"),
                        (1, 2, 1, "fsdp-zero2")],
                    4: [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 2, 1, "allgather"), (2, 2, 1, "ulysses"),
                        (1, 4, 1, "hybrid"), (1, 2, 2, "fsdp"),
                        (1, 2, 2, "fsdp-per-microbatch"), (2, 2, 1, "fsdp"), (1, 4, 1, "fsdp-ac"),
                        (2, 2, 1, "fsdp-full-build")],
                    8: [(2, 2, 2), (2, 4, 1, "hybrid"), (2, 2, 2, "fsdp")]}
LAYOUTS = [layout for layouts in LAYOUTS_BY_WORLD.values() for layout in layouts if layout != REFERENCE]
STEP1_TOL, CURVE_TOL = 1e-6, 1e-5
STEPS = trainer_cases.CURVE_STEPS  # past the warm-up and into clipping: the curves of 20 layouts in under a minute


def _name(layout: tuple) -> str:
    return "tp{}-cp{}-dp{}".format(*layout[:3]) + "".join(f"-{extra}" for extra in layout[3:])


def _sizes(layout: tuple) -> tuple[int, ...]:
    """(tp, cp, dp) and, for hybrid CP, the Ulysses size."""
    overrides = VARIANTS.get(layout[3], {}) if len(layout) > 3 else {}
    return layout[:3] + ((overrides["parallel.ulysses_size"],) if "parallel.ulysses_size" in overrides else ())


def worst_grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert grads.keys() == ref.keys()
    errors = {name: rel_err(grads[name], ref[name]) for name in ref}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module")
def runs(spawn_world, corpus, tmp_path_factory) -> dict[tuple[int, int, int], list[dict]]:
    """Per layout, every rank's answer from ``trainer_cases.train_layout`` (``STEPS`` steps)."""
    out = {}
    for world, layouts in LAYOUTS_BY_WORLD.items():
        for layout in layouts:
            run_dir = str(tmp_path_factory.mktemp(f"run-{_name(layout)}"))
            overrides = {**trainer_cases.CURVE, **(VARIANTS[layout[3]] if len(layout) > 3 else {})}
            out[layout] = spawn_world(world).run(run_with_parallel, _sizes(layout), trainer_cases.train_layout,
                                                 corpus, run_dir, overrides,
                                                 build_on_meta=layout[3:] != ("fsdp-full-build",))
    return out


def test_reference_run_learns(runs) -> None:
    """...with clipping active on some steps, so the global-norm computation matters to the curve."""
    losses, norms = runs[REFERENCE][0]["losses"], runs[REFERENCE][0]["grad_norms"]
    clip = trainer_cases.CURVE["optimizer.clip_grad"]
    assert any(norm > clip for norm in norms.values()) and any(norm < clip for norm in norms.values()), norms
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (STEPS - 2, STEPS - 1, STEPS)) / 3
    assert last < first - 0.05, f"the loss did not fall: {losses}"


def test_cp_ranks_hold_unequal_loss_tokens(runs) -> None:
    """The data is a real test of the reduction: CP ranks of one replica count different loss tokens."""
    for layout in LAYOUTS:
        tokens = [answer["local_tokens"] for answer in runs[layout]]
        assert len(set(tokens)) > 1, f"{layout}: every rank holds {tokens[0]} loss tokens"
    total = runs[REFERENCE][0]["local_tokens"]
    assert total < trainer_cases.GLOBAL_BATCH * trainer_cases.SEQ_LEN * 0.9, "too few masked tokens"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
def test_step1_loss_and_gradients_match_unsharded(runs, layout) -> None:
    ref, got = runs[REFERENCE][0], runs[layout][0]
    loss_error = rel_err(got["losses"][1], ref["losses"][1])
    assert loss_error <= STEP1_TOL, f"{layout}: step-1 loss {got['losses'][1]} vs {ref['losses'][1]}"
    error, name = worst_grad_error(got["grads"], ref["grads"])
    assert error <= STEP1_TOL, f"{layout}: step-1 gradient of {name} off by {error:.2e} relative"
    digests = {answer["grad_digest"] for answer in runs[layout]}
    assert len(digests) == 1, f"{layout}: ranks hold different (full) gradients after the DP x CP sum"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
def test_loss_curve_matches_unsharded(runs, layout) -> None:
    ref, got = runs[REFERENCE][0]["losses"], runs[layout][0]["losses"]
    assert got.keys() == ref.keys()
    errors = {step: rel_err(got[step], ref[step]) for step in ref}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= CURVE_TOL, f"{layout}: step {worst} loss {got[worst]} vs {ref[worst]}"
    assert all(answer["losses"] == got for answer in runs[layout]), "ranks logged different losses"
    ref_norms, got_norms = runs[REFERENCE][0]["grad_norms"], runs[layout][0]["grad_norms"]
    assert all(rel_err(got_norms[s], ref_norms[s]) <= CURVE_TOL for s in ref_norms), "global gradient norms differ"
    ref_eval, got_eval = runs[REFERENCE][0]["eval_losses"], runs[layout][0]["eval_losses"]
    assert tuple(sorted(ref_eval)) == trainer_cases.CURVE_EVALS and got_eval.keys() == ref_eval.keys()
    assert all(rel_err(got_eval[s], ref_eval[s]) <= CURVE_TOL for s in ref_eval), (got_eval, ref_eval)


def test_document_mask_changes_the_run(spawn_world, runs, corpus, tmp_path) -> None:
    """Negative control: the runs above mask attention per document; without the mask the loss differs."""
    got = spawn_world(1).run(run_with_parallel, REFERENCE, trainer_cases.train_layout, corpus, str(tmp_path),
                             {"data.document_mask": False}, 1)[0]
    assert rel_err(got["losses"][1], runs[REFERENCE][0]["losses"][1]) > 1e-4


def test_nan_loss_stops_the_run_naming_the_step(spawn_world, corpus, tmp_path) -> None:
    errors = spawn_world(2).run(run_with_parallel, (1, 2, 1), trainer_cases.train_until_nan, corpus, str(tmp_path), 3)
    assert all(error.startswith("loss is nan at step 3: stopping the run") for error in errors), errors
    assert all(error.endswith("(after 2 steps)") for error in errors), errors


def test_per_rank_mean_reduction_is_caught(spawn_world, runs, corpus, tmp_path) -> None:
    """Negative control: normalising by each rank's own token count moves the gradients far past 1e-6."""
    got = spawn_world(2).run(run_with_parallel, (1, 2, 1), trainer_cases.train_with_per_rank_mean_loss, corpus,
                             str(tmp_path))[0]
    error, name = worst_grad_error(got["grads"], runs[REFERENCE][0]["grads"])
    assert error > 100 * STEP1_TOL, f"the per-rank-mean bug went unnoticed ({name}: {error:.2e})"


def test_fsdp_state_bytes_fall_with_dp_cp_and_tp(runs) -> None:
    """Parameters, gradients and AdamW moments held per rank (measured): the TP-sharded tensors' share falls by
    tp x dp x cp, the TP-replicated norm weights' by dp x cp (the tiny model's dims split evenly: no padding)."""
    ref = runs[REFERENCE][0]["setup"]
    total, replicated = ref["parameters"], (2 * trainer_cases.TINY_MODEL["num_layers"] + 1) * 32
    assert ref["parameters_per_rank"] == total and ref["state_bytes_per_rank"] >= 16 * total
    for layout in LAYOUTS:
        if layout[3:] and layout[3] not in FSDP:
            continue
        tp, cp, dp = layout[:3]
        shards = dp * cp if layout[3:] else 1
        share = ((total - replicated) / tp + replicated) / total / shards
        setup = runs[layout][0]["setup"]
        assert setup["fsdp"] == bool(layout[3:])
        got = setup["state_bytes_per_rank"] / ref["state_bytes_per_rank"]
        assert abs(got / share - 1) <= 0.01, f"{layout}: state bytes per rank {got:.4f} of (1,1,1)'s, not {share:.4f}"
        by_rank = setup["state_bytes_by_rank"]
        assert max(by_rank) - min(by_rank) <= 0.01 * ref["state_bytes_per_rank"], f"{layout}: {by_rank}"


def test_dry_run_plans_the_measured_state_bytes(runs, corpus) -> None:
    """``train.py --dry-run``'s per-rank parameter, gradient and optimizer bytes (meta tensors) are the bytes the
    runs measured, rank by rank, with DDP and with FSDP."""
    for layout in [REFERENCE, *LAYOUTS]:
        if layout[3:] and layout[3] not in FSDP:
            continue
        overrides = {**VARIANTS.get(layout[3], {}), "parallel.backend": "gloo"} if layout[3:] else {}
        dims = ParallelDims(tp=layout[0], cp=layout[1], dp=layout[2])
        _, ranks, _, _ = dry_run.memory_plan(trainer_cases.tiny_config(corpus, "unused", dims, **overrides), dims.world)
        setup = runs[layout][0]["setup"]
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "state_bytes"):
            assert [getattr(rank, key) for rank in ranks] == setup[f"{key}_by_rank"], (layout, key)


def test_meta_build_trains_like_a_full_build(runs) -> None:
    """The meta-device build materialises each shard with exactly the full build's values."""
    meta, full = runs[(2, 2, 1, "fsdp")], runs[(2, 2, 1, "fsdp-full-build")]
    assert [answer["losses"] for answer in meta] == [answer["losses"] for answer in full]
    assert meta[0]["grad_digest"] == full[0]["grad_digest"]


def test_fsdp_left_averaging_is_caught(spawn_world, runs, corpus, tmp_path) -> None:
    """Negative control: FSDP2's default (the mean over DP x CP) scales the gradients by 1 / (dp x cp)."""
    got = spawn_world(2).run(run_with_parallel, (1, 2, 1), trainer_cases.train_with_fsdp_averaging, corpus,
                             str(tmp_path))[0]
    error, name = worst_grad_error(got["grads"], runs[REFERENCE][0]["grads"])
    assert error > 0.4, f"FSDP's averaging went unnoticed ({name}: {error:.2e})"
