"""Metrics that survive resumes: the wandb run and group a checkpoint saved are continued, a layout change is an
event record, both MFU conventions are named, and the plots take several runs with a memory panel."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cp_train.cli.plot import run as plot_main
from cp_train.metrics.throughput import IntervalMeter
from cp_train.metrics.writers import METRICS_FILE, MetricWriters, SinkSettings, console_line
from cp_train.model.config import ModelConfig
from cp_train.run_log import layout_event


def test_a_resumed_run_continues_its_wandb_run_and_group(tmp_path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    calls: list[dict] = []

    def init(**kwargs):  # noqa: ANN202 - stands in for wandb.init
        calls.append(kwargs)
        return SimpleNamespace(id=kwargs.get("id", "fresh123"), log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setattr(wandb, "init", init)
    layout = {"tp": 1, "cp": 4, "dp": 1, "seq_len": 8}
    settings = dict(run_dir=tmp_path, run_name="run", total_steps=4, layout=layout, use_wandb=True,
                    wandb_mode="offline")
    fresh = MetricWriters(SinkSettings(**settings), stream=io.StringIO())
    assert fresh.wandb_state() == {"id": "fresh123", "group": "tp1-cp4-dp1-seq8"} and "id" not in calls[0]
    resumed = MetricWriters(SinkSettings(**settings, wandb_id="abc", wandb_group="tp1-cp2-dp1-seq8"),
                           stream=io.StringIO())
    assert calls[1]["id"] == "abc" and calls[1]["resume"] == "allow" and calls[1]["group"] == "tp1-cp2-dp1-seq8"
    assert resumed.wandb_state() == {"id": "abc", "group": "tp1-cp2-dp1-seq8"}


def test_layout_change_event_and_both_mfus() -> None:
    trainer = SimpleNamespace(step=6, state=SimpleNamespace(dims={"tp": 1, "cp": 4, "dp": 1}))
    assert layout_event(None, trainer) == []
    assert layout_event({"layout": {"tp": 1, "cp": 4, "dp": 1}}, trainer) == []
    [event] = layout_event({"layout": {"tp": 1, "cp": 2, "dp": 2, "world_size": 4}}, trainer)
    assert event == {"kind": "event", "step": 6, "event": "layout_change", "from": "tp1-cp2-dp2", "to": "tp1-cp4-dp1",
                     "detail": "tp1-cp2-dp2 -> tp1-cp4-dp1"}
    assert console_line(event, 10, 0.0, 0) == "event step 6: layout_change tp1-cp2-dp2 -> tp1-cp4-dp1"
    model = ModelConfig(vocab_size=128, num_layers=2, hidden_size=64, num_heads=4, max_position_embeddings=4096)
    meter = IntervalMeter.for_model(model, 4096, 2, 2, peak=1.0)
    meter.add(1.0, 0.1, 0.0)
    record = meter.record(1, 1e-3, 0.5, 2, 4096, 0.1)
    # dense counts attention in full: 12 L h s per token against the causal 6 L h s
    assert record["mfu_dense"] / record["mfu"] == pytest.approx(meter.full_flops_per_token / meter.flops_per_token)
    assert record["mfu_dense"] > record["mfu"]
    line = console_line({**record, "peak_memory_max_gib": 0.5, "peak_memory_pct": 25.0, "step_time_max_s": 0.2},
                        10, 0.0, 0)
    assert f"MFU {100 * record['mfu']:.1f}% (causal; dense {100 * record['mfu_dense']:.1f}%)" in line
    assert "step 0.200s" in line and "mem 0.50 GiB max, 25%" in line


def test_plot_takes_several_runs_with_a_memory_panel_and_layout_changes(tmp_path) -> None:
    for cp in (2, 4, 8):
        run_dir = tmp_path / f"cp{cp}"
        run_dir.mkdir()
        with open(run_dir / METRICS_FILE, "w") as handle:
            for step in range(1, 9):
                handle.write(json.dumps({"kind": "train", "step": step, "loss": 5.0 / step, "mfu": 0.1 * cp,
                                         "mfu_dense": 0.12 * cp, "tokens_per_s_per_device": 1e3 / cp,
                                         "tflops_per_device": 0.01, "peak_memory_max_gib": 1.0 / cp,
                                         "peak_memory_pct": 10.0 / cp}) + "\n")
            if cp == 4:
                handle.write(json.dumps({"kind": "event", "step": 4, "event": "layout_change"}) + "\n")
    written = plot_main([str(tmp_path / f"cp{cp}") for cp in (2, 4, 8)] + ["--out", str(tmp_path / "plots")])
    assert [p.name for p in written] == ["loss.png", "throughput.png", "memory.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000 for p in written)
    assert Path(tmp_path / "plots").is_dir()
