"""``bench/offload.py`` runs end to end on CPU at toy sizes, so the GPU benchmark is not first run on a GPU."""

from __future__ import annotations

from bench import offload as bench_offload


def test_offload_benchmark_smoke_run_on_cpu(capsys) -> None:
    records = bench_offload.main(["--device", "cpu", "--tiny"])
    assert [(r["seq"], r["offload"]) for r in records] == [(64, "none"), (64, "checkpointed"), (128, "none"),
                                                            (128, "checkpointed")]
    assert not any(r["oom"] for r in records) and all(r["tokens_per_s"] > 0 for r in records)
    offloaded = [r for r in records if r["offload"] != "none"]
    assert all(r["host_gib"] > 0 and r["fetched_late"] == 0 and r["peak_layers"] == 2 for r in offloaded), records
    assert all(r["vs_none"] > 0 for r in records)
    assert "vs none" in capsys.readouterr().out


def test_an_offload_case_past_the_hosts_memory_is_not_run(monkeypatch, capsys) -> None:
    """The 2x case's pinned bytes, scaled from the case at half its length, pass 90% of the host's available memory
    (here set just above the first case's): reported as not run, with the reason; the cases without offload run."""
    first = bench_offload.main(["--device", "cpu", "--tiny", "--seq", "64"])[1]["host_gib"]
    monkeypatch.setattr(bench_offload, "host_available_gib", lambda: 1.5 * first)
    records = bench_offload.main(["--device", "cpu", "--tiny", "--seq", "64"])
    assert [r.get("skipped") is None for r in records] == [True, True, True, False]
    assert records[3]["oom"] and records[3]["skipped"].startswith("host memory: about")
    assert records[2]["vs_none"] == 1.0 and records[3]["vs_none"] is None
    assert bench_offload.host_shortfall([], 64, "checkpointed") is None  # nothing ran yet: nothing to scale
