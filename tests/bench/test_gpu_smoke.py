"""``bench/gpu.py`` runs end to end on CPU at toy sizes, so the GPU benchmark is not first run on a GPU."""

from __future__ import annotations

from bench import gpu


def test_gpu_benchmark_smoke_run_on_cpu(capsys) -> None:
    records = gpu.main(["--device", "cpu", "--tiny", "--models", "gpt-1b"])
    kernels = {r["case"] for r in records if r["part"] == "kernels"}
    assert {"sdpa_flash", "ring_path", "ring_blocks", "kernel:torch cpu flash"} <= kernels
    assert all(r["tflops"] > 0 and r["ratio"] > 0 for r in records if r["part"] == "kernels")
    # the other model eager only: compiling it too would cost a fresh machine's cold Inductor cache 15 s
    records += gpu.main(["--device", "cpu", "--tiny", "--parts", "training", "--models", "gpt-125m",
                         "--modes", "eager"])
    training = {r["case"]: r for r in records if r["part"] == "training"}
    assert set(training) == {"gpt-125m eager", "gpt-1b eager", "gpt-1b compiled"}
    assert all(r["tokens_per_s"] > 0 and r["host_syncs"] == "n/a" for r in training.values())
    assert training["gpt-1b compiled"]["activation_checkpointing"]  # the shipped config's setting
    out = capsys.readouterr().out
    assert "vs sdpa_flash" in out and "host syncs" in out
