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
