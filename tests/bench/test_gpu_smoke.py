"""``bench/gpu.py`` runs end to end on CPU at toy sizes, so the GPU benchmark is not first run on a GPU."""

from __future__ import annotations

from bench import gpu


def test_gpu_benchmark_smoke_run_on_cpu(capsys) -> None:
    records = gpu.main(["--device", "cpu", "--tiny"])
    kernels = {r["case"] for r in records if r["part"] == "kernels"}
    assert {"sdpa_flash", "ring_path", "ring_blocks", "kernel:torch cpu flash"} <= kernels
    assert all(r["tflops"] > 0 and r["ratio"] > 0 for r in records if r["part"] == "kernels")
    training = {r["case"]: r for r in records if r["part"] == "training"}
    assert set(training) == {f"{model} {mode}" for model in ("gpt-125m", "gpt-1b") for mode in ("eager", "compiled")}
    assert all(r["tokens_per_s"] > 0 and r["host_syncs"] == "n/a" for r in training.values())
    assert training["gpt-1b compiled"]["activation_checkpointing"]  # the shipped config's setting
    out = capsys.readouterr().out
    assert "vs sdpa_flash" in out and "host syncs" in out
