"""Sequence parallelism (``parallel.sequence_parallel``, on by default at tp > 1): the tiny trainer run
(``trainer_cases.CURVE``: 6 steps past the warm-up and into clipping, as the equivalence runs; fp32, document
masks) at (tp, cp) = (2, 1), (2, 2) and (4, 2) equals the unsharded run: step-1 loss and gradients within 1e-6,
the loss curve within 1e-5; also with selective checkpointing and a chunked MLP, with FSDP, and with SP turned
off. The model here has 4 kv heads, so that tp 4 divides them.
"""

from __future__ import annotations

import pytest

from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate
from cp_train.parallel.mesh.state import ParallelDims, run_with_parallel
from tests import trainer_cases
from tests.numerics import rel_err
from tests.train.test_equivalence import CURVE_TOL, STEP1_TOL, worst_grad_error

MODEL = {"model.num_kv_heads": 4, **trainer_cases.CURVE}
REFERENCE = ((1, 1, 1), {})
RUNS = {"tp2-cp1": ((2, 1, 1), {}), "tp2-cp2": ((2, 2, 1), {}), "tp4-cp2": ((4, 2, 1), {}),
        "tp2-cp2-selective": ((2, 2, 1), {"model.activation_checkpointing": "selective", "model.mlp_chunks": 2}),
        "tp2-cp2-full": ((2, 2, 1), {"model.activation_checkpointing": "full"}),
        "tp2-cp2-fsdp": ((2, 2, 1), {"parallel.fsdp": True, "train.micro_batch_size": 1}),
        "tp2-cp2-no-sp": ((2, 2, 1), {"parallel.sequence_parallel": False})}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module")
def runs(spawn_world, corpus, tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    for name, (sizes, overrides) in {"reference": REFERENCE, **RUNS}.items():
        run_dir = str(tmp_path_factory.mktemp(f"run-{name}"))
        out[name] = spawn_world(sizes[0] * sizes[1] * sizes[2]).run(
            run_with_parallel, sizes, trainer_cases.train_layout, corpus, run_dir, {**MODEL, **overrides})
    return out


@pytest.mark.parametrize("name", RUNS)
def test_sequence_parallel_run_equals_unsharded(runs, name) -> None:
    ref, got = runs["reference"][0], runs[name][0]
    assert rel_err(got["losses"][1], ref["losses"][1]) <= STEP1_TOL, (got["losses"][1], ref["losses"][1])
    error, param = worst_grad_error(got["grads"], ref["grads"])
    assert error <= STEP1_TOL, f"{name}: step-1 gradient of {param} off by {error:.2e} relative"
    assert len({answer["grad_digest"] for answer in runs[name]}) == 1, "ranks hold different full gradients"
    worst = max(rel_err(got["losses"][s], ref["losses"][s]) for s in ref["losses"])
    assert got["losses"].keys() == ref["losses"].keys() and worst <= CURVE_TOL, worst
    assert all(answer["losses"] == got["losses"] for answer in runs[name]), "ranks logged different losses"


def test_setup_record_says_whether_the_sequence_is_sharded(runs) -> None:
    assert runs["tp2-cp2"][0]["setup"]["sequence_parallel"] is True
    assert runs["tp2-cp2-no-sp"][0]["setup"]["sequence_parallel"] is False
    assert runs["reference"][0]["setup"]["sequence_parallel"] is False


def test_a_local_length_tp_does_not_divide_is_refused_naming_the_fix(tmp_path) -> None:
    config = trainer_cases.tiny_config("unused", str(tmp_path), ParallelDims(tp=4, cp=2, dp=1), **MODEL,
                                       **{"data.seq_len": 36})
    with pytest.raises(ConfigError, match=r"seq_len/cp = 18 tokens over tp = 4.*multiple of 8.*"
                                          r"sequence_parallel=false"):
        validate(config, 8)
    config.parallel.sequence_parallel = False
    assert validate(config, 8) == 1
