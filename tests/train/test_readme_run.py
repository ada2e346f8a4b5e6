"""The README's training command, shortened by overrides, end to end: torchrun, 2 gloo ranks, cp=2.

Runs in a fresh cache (the embedded corpus is built on first use, as on a fresh clone) and writes
the JSONL, the resolved config and a wandb offline run to the run directory; the loss falls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cp_train.cli.plot import run as plot_main
from cp_train.parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL = 8, 4


def test_readme_training_command_with_cp2(tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key: wandb must go offline
    env.update({"CP_TRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "train.py", "--config", "launch/configs/cpu-tiny.yaml",
               "--train-steps", str(STEPS), "--lr-warmup-iters", "4", "--set", f"logging.dir={run_dir}", "--set",
               f"logging.interval={INTERVAL}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"train.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert f"step {STEPS}/{STEPS} [####################] 100%" in done.stdout
    assert "world 2 = tp 1 x cp 2 x dp 1" in done.stdout

    setup, *records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert setup["kind"] == "setup" and setup["parameters"] == setup["parameters_per_rank"] > 0
    assert setup["attention_kernels"] == "torch cpu flash"  # the kernel chosen for this run's attention
    assert setup["state_bytes_per_rank"] >= 16 * setup["parameters"] and not setup["fsdp"]  # DDP: replicated
    assert all("step" in r and "loss" in r for r in records)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert train[-1]["loss"] < train[0]["loss"] - 0.3, [r["loss"] for r in train]
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 and 0 < r["mfu"] for r in train)
    assert train[-1]["consumed_samples"] == STEPS * 8
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [STEPS] and evals[0]["loss"] > 0

    offline_runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline_runs) == 1, "expected one wandb offline run"
    stored = offline_runs[0].read_bytes()  # the run name, group, config and history live in this file
    for expected in (b"cpu-tiny-tp1-cp2-dp1-seq256", b"train/loss", b"train/mfu", b"eval/loss"):
        assert expected in stored, expected
    assert "cp: 2" in (run_dir / "config.yaml").read_text()
    assert [p.name for p in plot_main([str(run_dir)])] == ["loss.png", "throughput.png", "memory.png"]
