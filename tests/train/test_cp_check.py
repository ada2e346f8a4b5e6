"""``train.check_cp_every``: the run checks its CP loss against the same micro-batch without CP.

Clean runs (cp 2 ring, cp 4 Ulysses, cp 2 all-gather with a sliding window; 4 spawned gloo ranks, fp32) record
``cp_check_rel_err`` <= 1e-5 at every check, and their losses are bitwise those of the same run without the check;
with a communication fault injected below the project (every ring message arriving as zeros, every all-to-all
delivering zeros) the run stops at the first check with one line.
"""

from __future__ import annotations

import pytest

from cp_train.parallel.mesh.state import run_with_parallel
from tests import cp_check_cases, trainer_cases

STEPS, EVERY = 4, 2
BASE = {"train.steps": STEPS, "logging.interval": 3, "train.valid_interval": 0}
CHECK = {"train.check_cp_every": EVERY}
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
    sizes, overrides = CLEAN[name]
    checked = _run(spawn_world, corpus, str(tmp_path / "checked"), sizes, {**overrides, **CHECK})
    plain = _run(spawn_world, corpus, str(tmp_path / "plain"), sizes, overrides)
    assert checked["failure"] is None and sorted(checked["checks"]) == [2, 4], checked
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
