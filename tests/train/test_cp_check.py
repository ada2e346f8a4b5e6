"""``train.check_cp_every``: the run checks its CP loss against the same micro-batch without CP.

Clean runs (cp 2 ring, cp 4 Ulysses, cp 2 all-gather with a sliding window; 4 spawned gloo ranks, fp32) record
``cp_check_rel_err`` <= 1e-5 at every check, and their losses are bitwise those of the same run without the check;
with a communication fault injected below the project (every ring message arriving as zeros, every all-to-all
delivering zeros) the run stops at the first check with one line.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.mesh.state import run_with_parallel
from cp_train.runtime import replica_check
from tests import cp_check_cases, trainer_cases

STEPS, EVERY = 4, 2
BASE = {"train.steps": STEPS, "logging.interval": 3, "train.valid_interval": 0}
CHECK = {"train.check_cp_every": EVERY}
REPLICAS = {"train.check_replicas_every": EVERY}
WINDOW = {"model.layer_types": ["sliding_attention", "full_attention"], "model.sliding_window": 8}
CLEAN = {"cp2-ring": ((1, 2, 2), {}), "cp4-ulysses": ((1, 4, 1), {"parallel.cp_algorithm": "ulysses"}),
         "cp2-allgather-window": ((1, 2, 2), {"parallel.cp_algorithm": "allgather", **WINDOW})}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def _run(spawn_world, corpus: str, run_dir: str, sizes: tuple, overrides: dict, fault: str | None = None) -> dict:
    return spawn_world(4).run(run_with_parallel, sizes, cp_check_cases.train_checked, corpus, run_dir,
                              {**BASE, **overrides}, fault)[0]


@pytest.mark.parametrize("name", list(CLEAN))
def test_a_clean_run_passes_every_check_with_its_losses_unchanged(spawn_world, corpus, tmp_path, name) -> None:
    """Also the replica check (``train.check_replicas_every``): DDP's dp x cp ranks hold the same weights."""
    sizes, overrides = CLEAN[name]
    checked = _run(spawn_world, corpus, str(tmp_path / "checked"), sizes, {**overrides, **CHECK, **REPLICAS})
    plain = _run(spawn_world, corpus, str(tmp_path / "plain"), sizes, overrides)
    assert checked["failure"] is None and sorted(checked["checks"]) == [2, 4], checked
    agree = [m for m in checked["messages"] if m.startswith("replica check")]
    replicas = sizes[1] * sizes[2]
    assert agree == [f"replica check at step 2: the {replicas} replicas of the weights agree (15 tensors, the dp x "
                     f"cp group); checked every 2 steps"], checked["messages"]
    assert all(0 <= err <= 1e-5 for err in checked["checks"].values()), checked["checks"]
    assert checked["losses"] == plain["losses"] and sorted(plain["losses"]) == list(range(1, STEPS + 1))
    assert plain["checks"] == {}


@pytest.mark.parametrize("fault, sizes, overrides", [
    ("ring", (1, 2, 2), {}), ("all_to_all", (1, 4, 1), {"parallel.cp_algorithm": "ulysses"})])
def test_a_lost_message_stops_the_run_at_the_first_check(spawn_world, corpus, tmp_path, fault, sizes,
                                                         overrides) -> None:
    """The faulty run trains on (its losses plausible, within a few % of the clean run's) until step 2, the first
    check, where every rank stops with the line."""
    clean = _run(spawn_world, corpus, str(tmp_path / "clean"), sizes, overrides)
    broken = _run(spawn_world, corpus, str(tmp_path / "broken"), sizes, {**overrides, **CHECK}, fault)
    line = broken["failure"]
    assert line is not None and line.startswith("CP check at step 2: "), line
    assert "train.check_cp_tolerance" in line and f"cp{sizes[1]} " in line, line
    assert sorted(broken["losses"]) == [1, 2]  # read at the check, before the stop
    assert broken["losses"][1] != clean["losses"][1]
    assert abs(broken["losses"][1] / clean["losses"][1] - 1) < 0.05  # plausible: nothing else would notice


def test_the_tolerance_defaults_by_dtype_and_bad_settings_are_one_line() -> None:
    import torch

    from cp_train.config.schema import ConfigError
    from cp_train.config.sources import load_config
    from cp_train.config.validate import validate
    from cp_train.runtime.cp_check import tolerance

    assert tolerance(None, None) == 1e-5 and tolerance(None, torch.bfloat16) == 2e-2 and tolerance(3e-3, None) == 3e-3
    for key, value, message in (("train.check_cp_every", -1, "train.check_cp_every"),
                                ("train.check_cp_tolerance", 0, "train.check_cp_tolerance must be > 0")):
        config = load_config("launch/configs/cpu-tiny.yaml", overrides=[f"{key}={value}"])
        with pytest.raises(ConfigError, match=message):
            validate(config, 2)


def test_a_replica_that_differs_by_one_bit_stops_the_run(spawn_world, corpus, tmp_path) -> None:
    """Rank 3 flips the lowest bit of one element of one weight after step 2's update: the replica check of step
    2 stops every rank with the line naming the rank and the tensor."""
    broken = _run(spawn_world, corpus, str(tmp_path / "broken"), (1, 2, 2), REPLICAS, "replica")
    assert broken["failure"] == (f"replica check at step 2: the weights differ from their replicas' (the dp x cp "
                                 f"group) on rank 3: {cp_check_cases.CORRUPTED}: {replica_check.HINT}"), broken


def test_the_replica_check_needs_replicas() -> None:
    from cp_train.config.schema import ConfigError
    from cp_train.config.sources import build_config
    from cp_train.config.validate import validate

    def config(**values: object):
        return build_config([("test", {"parallel.cp": 2, "train.check_replicas_every": 10, **values})])

    assert validate(config(), 4) == 2  # DDP: dp x cp = 4 replicas
    validate(config(**{"parallel.fsdp": True, "parallel.dp_replicate": 2}), 4)  # HSDP's 2 replicas
    with pytest.raises(ConfigError, match=r"^train.check_replicas_every 10 compares the replicas of the weights and "
                                          r"this layout has none \(FSDP shards them\): use DDP"):
        validate(config(**{"parallel.fsdp": True}), 4)
    with pytest.raises(ConfigError, match=r"has none \(dp x cp is 1\)"):
        validate(config(**{"parallel.cp": 1, "parallel.tp": 2}), 2)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_fingerprint_changes_with_any_bit_or_order(monkeypatch, dtype) -> None:
    """Equal tensors give equal fingerprints; one flipped bit, two swapped elements or a chunk moved change it
    (small chunks and blocks here: the tensor spans several of each)."""
    monkeypatch.setattr(replica_check, "CHUNK", 8)
    monkeypatch.setattr(replica_check, "BLOCK", 32)
    tensor = torch.randn(101, generator=torch.Generator().manual_seed(0)).to(dtype)
    fingerprint = replica_check.fingerprint
    assert fingerprint(tensor) == fingerprint(tensor.clone().reshape(1, 101))
    flipped = tensor.clone()
    flipped.view(replica_check.INTEGER_VIEW[tensor.element_size()])[40] ^= 1
    swapped, moved = tensor.clone(), tensor.clone()
    swapped[[3, 4]] = tensor[[4, 3]]
    moved[:8], moved[8:16] = tensor[8:16], tensor[:8]
    assert len({int(fingerprint(t)) for t in (tensor, flipped, swapped, moved)}) == 4


def test_the_ranks_that_differ_from_most_of_their_replicas_are_named() -> None:
    """Within each set of replicas the rank off the majority is named, per tensor; two replicas that disagree name
    both; sets are compared apart (``[set, fingerprint per tensor]`` rows by rank)."""
    names = ["a", "b"]
    rows = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 9], [3, 5, 6], [3, 7, 6], [5, 1, 1]])
    assert replica_check.compare_replicas(rows, names) == ({2: ["b"], 3: ["a"], 4: ["a"]}, 3)
    assert replica_check.compare_replicas(rows[[0, 1, 5]], names) == ({}, 2)
