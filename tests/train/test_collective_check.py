"""``parallel.check_collectives`` in real 2-rank runs (cp 2, through ``cp_train.cli.launch``): a rank that issues
another collective is named at the next log step, a rank that skips one is named while its peer waits, both in one
line."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import trainer_cases
from tests.entry_points import Outcome, assert_one_line, write_config
from tests.entry_points import run as run_train

# the skipped collective's run first: it waits out its short timeout while the others run beside it
FAULTS = {"skip": ("skip", {"parallel.timeout_minutes": 0.15}), "clean": ("", {}), "swap": ("swap", {})}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """The three runs, two at a time: each 4 steps, a log step every 2, with the check on; ``COLLECTIVE_FAULT``
    names the fault rank 1 makes."""
    root = tmp_path_factory.mktemp("collective-check")
    corpus = trainer_cases.write_corpus(root / "docs")

    def one(name: str) -> Outcome:
        fault, overrides = FAULTS[name]
        config = write_config(root / f"{name}.yaml", corpus, root / name, cp=2, **{
            "train.steps": 4, "logging.interval": 2, "parallel.check_collectives": True,
            "train.imports": ["tests.collective_faults"], **overrides})
        return run_train(["--config", str(config)], world=2, launcher="launch", timeout=240,
                         env={"COLLECTIVE_FAULT": fault})

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(FAULTS, pool.map(one, FAULTS), strict=True))


def test_a_clean_run_passes_the_check(outcomes) -> None:
    outcome = outcomes["clean"]
    assert outcome.returncode == 0, outcome.output[-3000:]


def test_another_collective_stops_the_run_at_the_next_log_step(outcomes) -> None:
    line = assert_one_line(outcomes["swap"], 1, r"collective check at step 2: the ranks' collectives "
                           r"on the dp_cp group \(ranks 0, 1\) differ at call \d+: rank 0: all_reduce float64\[1\] at "
                           r"cp_train/loss\.py:\d+; rank 1: all_reduce int64\[1\] at tests/collective_faults\.py:\d+")
    assert "skipped one or issued another" in line


def test_a_skipped_collective_is_named_while_the_peer_waits(outcomes) -> None:
    outcome = outcomes["skip"]
    lines = [line for line in outcome.output.splitlines() if line.startswith("train.py: ")]
    assert outcome.returncode != 0 and len(lines) == 1, outcome.output[-3000:]
    # both ranks stall (rank 0 in the skipped call, rank 1 in the next one, the per-step stop agreement on the host
    # group); whichever claims the report first names the other's place
    rank0 = (r"train\.py: failed: rank 0: collective check: rank 0 has waited \d+ s in call \d+ on the dp_cp group "
             r"\(ranks 0, 1\): all_reduce float64\[1\] at cp_train/loss\.py:\d+; rank 1 issued \d+ calls on that group "
             r"and waits in call \d+ on the host group \(all_reduce float64\[1\] at cp_train/preemption\.py:\d+\); the "
             r"first differing call is call \d+, which rank 1 never issued")
    rank1 = (r"train\.py: failed: rank 1: collective check: rank 1 has waited \d+ s in call \d+ on the host group "
             r"\(ranks 0, 1\): all_reduce float64\[1\] at cp_train/preemption\.py:\d+; rank 0 issued \d+ calls on that "
             r"group and waits in call \d+ on the dp_cp group \(all_reduce float64\[1\] at cp_train/loss\.py:\d+\); "
             r"the first differing call is call \d+, which rank 0 never issued")
    assert re.match(rank0, lines[0]) or re.match(rank1, lines[0]), lines[0]
