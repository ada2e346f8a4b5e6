"""``train.compile``: each block and the head with its loss compiled with ``fullgraph=True`` (the CP attention
is one operator, ``cp_train.parallel.cp.op``) train like eager, in six layouts and under selective
checkpointing.

Inductor compiles two of them in full, tp 2 x cp 2 (sequence parallel, the ring) and FSDP with activation
checkpointing. The others compile through everything Inductor does before its code generation
(``aot_eager_decomp_partition``: Dynamo's capture and guards, AOTAutograd with Inductor's decompositions and its
partitioner) and run the graphs as ATen ops: the C++ kernels Inductor generates on a CPU are code no GPU runs,
and building them was most of what these tests cost on a machine with empty caches (the suite's first run on it).

6 steps of the tiny fp32 run with packed documents (``trainer_cases.CURVE``), eager then compiled on the
same ranks: every step's loss within 1e-5 relative of eager's; no graph break (``fullgraph`` would raise,
and Dynamo's counter must stay empty); and no graph compiled after step 1, although every micro-batch brings
other document boundaries (a new CP plan).
"""

from __future__ import annotations

import pytest

from cp_train.parallel.mesh.state import run_with_parallel
from tests import compile_cases, trainer_cases
from tests.numerics import rel_err

FSDP = {"parallel.fsdp": True, "train.micro_batch_size": 1}
INDUCTOR, BEFORE_CODEGEN = "inductor", "aot_eager_decomp_partition"  # compile_cases.compiled_with
LAYOUTS = {  # name -> ((tp, cp, dp), overrides, the compiled run's backend)
    "tp1-cp1": ((1, 1, 1), {}, BEFORE_CODEGEN),
    "tp1-cp2-zigzag": ((1, 2, 1), {}, BEFORE_CODEGEN),
    "tp1-cp2-ulysses": ((1, 2, 1), {"parallel.cp_algorithm": "ulysses"}, BEFORE_CODEGEN),
    "tp1-cp2-allgather": ((1, 2, 1), {"parallel.cp_algorithm": "allgather"}, BEFORE_CODEGEN),
    "tp2-cp2": ((2, 2, 1), {}, INDUCTOR),  # sequence parallel (the default at tp > 1)
    "tp2-cp2-no-sp": ((2, 2, 1), {"parallel.sequence_parallel": False}, BEFORE_CODEGEN),
    "tp1-cp2-dp2-fsdp-checkpointing": ((1, 2, 2), {**FSDP, "model.activation_checkpointing": True}, INDUCTOR),
    "tp1-cp2-selective-checkpointing": ((1, 2, 1), {"model.activation_checkpointing": "selective"}, BEFORE_CODEGEN),
}
TOL = 1e-5
STEPS = trainer_cases.CURVE_STEPS  # past the warm-up and into clipping, as the equivalence runs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_training_equals_eager(spawn_world, corpus, tmp_path, name: str) -> None:
    dims, overrides, backend = LAYOUTS[name]
    ranks = spawn_world(dims[0] * dims[1] * dims[2]).run(
        run_with_parallel, dims, compile_cases.train_eager_and_compiled, corpus, str(tmp_path),
        {**trainer_cases.CURVE, **overrides}, backend)
    for rank, answer in enumerate(ranks):
        eager, compiled = answer["eager"], answer["compiled"]
        assert len(compiled["losses"]) == len(eager["losses"]) == STEPS
        errors = [rel_err(c, e) for c, e in zip(compiled["losses"], eager["losses"], strict=True)]
        assert max(errors) < TOL, (rank, errors)
        assert compiled["breaks"] == {}, (rank, compiled["breaks"])
        graphs = compiled["graphs"]
        assert graphs[0] > 0 and graphs[-1] == graphs[0], (rank, graphs)  # compiled in step 1, never again
        assert eager["graphs"][-1] == 0
        if rank == 0:  # the setup record (rank 0 writes the metrics) says what was compiled
            assert eager["compiled"] == ["nothing"] and compiled["compiled"] == ["blocks 0-1, head+loss"]


def test_the_constant_mark_is_torchs_own() -> None:
    """``constant_to_compile`` (which spares every start the Dynamo import) marks a function exactly as
    ``torch.compiler.assume_constant_result`` does."""
    import torch

    from cp_train.parallel.cp.spec import constant_to_compile

    def ours() -> int:
        return 1

    def theirs() -> int:
        return 1

    assert constant_to_compile(ours) is ours
    assert torch.compiler.assume_constant_result(theirs) is theirs and vars(ours) == vars(theirs) != {}
