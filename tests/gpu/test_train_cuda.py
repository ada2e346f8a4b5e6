"""``train.py`` on one GPU: bf16 autocast, a checkpoint (saved in the step, or written behind training from its
page-locked host copy with ``--async-save``), a resume whose losses equal the uninterrupted run's, and a profiled
run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cp_train.parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_AT = 12, 6


def _train(tmp_path: Path, name: str, *flags: str) -> dict[int, float]:
    run_dir = tmp_path / name
    env = {**os.environ, "CP_TRAIN_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(free_port()), "train.py", "--config", "launch/configs/cpu-tiny.yaml", "--cp-size", "1",
               "--set", "parallel.backend=nccl",  # cpu-tiny sets gloo: CPU ranks
               "--train-steps", str(STEPS), "--lr-warmup-iters", "2", "--set", "train.deterministic=true", "--set",
               "logging.wandb=false",
               "--set", "logging.interval=1", "--set", "train.valid_interval=0", "--set", f"logging.dir={run_dir}",
               *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"train.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "device cuda" in done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


@pytest.mark.parametrize("save", ["in the step", "async"])
def test_train_save_and_exact_resume_on_one_gpu(tmp_path: Path, save: str) -> None:
    checkpoints = tmp_path / "checkpoints"
    full = _train(tmp_path, "full", "--save", str(checkpoints), "--save-interval", str(SAVE_AT),
                  *(["--async-save"] if save == "async" else []))
    assert full[STEPS] < full[1] - 0.5, full
    resumed = _train(tmp_path, "resumed", "--load", str(checkpoints / f"step_{SAVE_AT:08d}"))
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(resumed[step] == full[step] for step in resumed), {s: (full[s], resumed[s]) for s in resumed}


def test_a_profiled_run_traces_the_kernels_and_the_allocator(tmp_path: Path) -> None:
    """``--profile --record-memory-history`` on CUDA: steps 4-5 traced with the device's kernels (matmuls among
    them), their idle fraction a fraction, and the caching allocator's history written beside the trace."""
    _train(tmp_path, "profiled", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
           "--record-memory-history")
    run_dir = tmp_path / "profiled"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (profile,) = [r for r in records if r.get("kind") == "profile"]
    assert profile["device"] == "cuda" and profile["profiled_steps"] == [4, 5]
    assert profile["by_kind_s"].get("matmul", 0) > 0 and 0 <= profile["idle_fraction"] < 1
    assert Path(profile["trace"]).is_file() and Path(profile["memory_snapshot"]).stat().st_size > 0
