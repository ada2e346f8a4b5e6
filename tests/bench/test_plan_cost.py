"""``bench.plan_cost`` runs small and finds the same plans with and without counting dense calls by segments."""

from __future__ import annotations

import json

import pytest

from bench import plan_cost


def test_plan_cost_gives_the_same_plans_as_its_baseline(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr("sys.argv", ["plan_cost", "--cp", "4", "--seq-len", "2048", "--median", "96",
                                     "--repeats", "1"])
    plan_cost.main()
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(records) == len(plan_cost.LAYOUTS) * len(plan_cost.ALGORITHMS)
    assert all(record["same_plans"] for record in records)
    assert plan_cost.batch_plan.dense_call_count is plan_cost.dense_call_count  # the baseline undone after it
