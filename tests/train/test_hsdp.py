"""HSDP (``parallel.dp_replicate``): FSDP shards over a replica's DP x CP ranks and replicates across replicas.

The tiny run at tp 1 x cp 2 x dp 2 (4 ranks, spawned gloo world, under the strict layer): HSDP with 2 replicas
against plain FSDP over all 4 ranks, and a checkpoint of the HSDP run resumed in both layouts.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.mesh.rank_groups import compute_rank_groups, crossing_nodes
from cp_train.parallel.mesh.state import run_with_parallel
from tests import trainer_cases
from tests.numerics import rel_err

FSDP = {"parallel.fsdp": True}
HSDP = {"parallel.fsdp": True, "parallel.dp_replicate": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def test_hsdp_groups_shard_inside_a_node_and_replicate_across() -> None:
    groups = compute_rank_groups(8, 1, 2, 4, dp_replicate=2)  # two "nodes" of 4 ranks
    assert groups.dp_shard_cp == ((0, 1, 2, 3), (4, 5, 6, 7)) and groups.dp_replicate[:2] == ((0, 4), (1, 5))
    assert crossing_nodes(groups, 4) == ("dp", "dp_cp", "dp_replicate")  # not the CP ring, not FSDP's gathers
    with pytest.raises(ValueError, match="parallel.dp_replicate 3 does not divide the DP size 4"):
        compute_rank_groups(8, 1, 2, 4, dp_replicate=3)


def test_hsdp_losses_equal_fsdp(spawn_world, corpus, tmp_path) -> None:
    """Also the replica check (``train.check_replicas_every``): each shard has its twin in the other replica."""
    world = spawn_world(4)
    fsdp = world.run(run_with_parallel, (1, 2, 2), trainer_cases.train_layout, corpus, str(tmp_path / "fsdp"),
                     FSDP)[0]
    hsdp = world.run(run_with_parallel, (1, 2, 2, 1, 2), trainer_cases.train_layout, corpus, str(tmp_path / "hsdp"),
                     {**HSDP, "train.check_replicas_every": 5})[0]
    assert sorted(hsdp["losses"]) == list(range(1, trainer_cases.STEPS + 1))
    assert ("replica check at step 5: the 2 replicas of the weights agree (15 tensors, the HSDP replicas); checked "
            "every 5 steps") in hsdp["messages"], hsdp["messages"]  # each FSDP shard against its twin
    for step, loss in fsdp["losses"].items():
        assert rel_err(hsdp["losses"][step], loss) <= 1e-6, (step, hsdp["losses"][step], loss)
        assert rel_err(hsdp["grad_norms"][step], fsdp["grad_norms"][step]) <= 1e-6


def test_hsdp_checkpoints_resume_bitwise_and_reshard_into_fsdp(spawn_world, corpus, tmp_path) -> None:
    """An HSDP run saved at step 4 of 8 resumes bitwise; the same checkpoint loads into plain FSDP (every value
    where it belongs) and the losses go on within 1e-5."""
    world, steps, save_at, want = spawn_world(4), 8, 4, ("params", "optimizer")

    def run(layout: tuple, run_dir: str, overrides: dict, until: int | None = None) -> dict:
        return world.run(run_with_parallel, layout, trainer_cases.train_layout, corpus, str(tmp_path / run_dir),
                         {"train.steps": steps, **overrides}, until, want)[0]

    hsdp_layout = (1, 2, 2, 1, 2)
    whole = run(hsdp_layout, "whole", HSDP)["losses"]
    first = run(hsdp_layout, "first", {**HSDP, "checkpoint.save": str(tmp_path / "ckpt")}, save_at)
    load = {"checkpoint.load": str(tmp_path / "ckpt")}
    for layout, overrides, exact in ((hsdp_layout, HSDP, True), ((1, 2, 2), FSDP, False)):
        resumed = run(layout, f"resumed-{len(layout)}", {**overrides, **load})
        assert resumed["step_at_start"] == save_at
        for kind in want:
            got, expected = resumed["start"][kind], first["end"][kind]
            assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), kind
        for step in range(save_at + 1, steps + 1):
            assert (resumed["losses"][step] == whole[step]) if exact else \
                rel_err(resumed["losses"][step], whole[step]) <= 1e-5, (layout, step)
