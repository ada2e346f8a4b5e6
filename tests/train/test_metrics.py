"""Metrics: peak table and MFU, interval throughput, peak memory, the writers (console, JSONL) and plots."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_train.cli.plot import run as plot_main
from cp_train.errors import InputError
from cp_train.metrics.plot import read_records
from cp_train.metrics.throughput import IntervalMeter, gpu_peak_tflops, peak_memory_gib, peak_tflops, reset_peak_memory
from cp_train.metrics.writers import METRICS_FILE, MetricWriters, SinkSettings, console_line, progress_bar, wandb_mode
from cp_train.model import ModelConfig, matmul_params


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H200-NVL", 835.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA H100 SXM5 80GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA GeForce RTX 4090", 165.2),
])
def test_gpu_peak_table(name, peak) -> None:
    assert gpu_peak_tflops(name) == peak


def test_peak_sources() -> None:
    assert gpu_peak_tflops("Some Future Accelerator") is None
    assert peak_tflops(torch.device("cpu"), None, 0.25) == (0.25, "logging.cpu_peak_tflops")
    assert peak_tflops(torch.device("cpu"), 500.0, 0.25) == (500.0, "logging.peak_tflops")


def test_unknown_gpu_reports_nan_mfu_with_one_warning(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Future X1")
    with pytest.warns(RuntimeWarning, match="unknown GPU 'NVIDIA Future X1'.*set logging.peak_tflops"):
        peak, source = peak_tflops(torch.device("cuda", 0), None, 0.2)
    assert math.isnan(peak) and "logging.peak_tflops" in source
    assert peak_tflops(torch.device("cuda", 0), 750.0, 0.2) == (750.0, "logging.peak_tflops")
    meter = IntervalMeter(tokens_per_step=4096, flops_per_token=1e9, world_size=1, peak_tflops=peak)
    meter.add(loss=2.0, step_time=0.5, data_time=0.1)
    record = meter.record(step=1, lr=1e-3, grad_norm=0.5, consumed_samples=8, seq_len=512, memory_gib=1.5,
                          memory_reserved_gib=2.0)
    assert math.isnan(record["mfu"]) and record["tflops_per_device"] > 0
    assert record["peak_memory_reserved_gib"] == 2.0
    line = console_line(record, 10, 0.0, 0)
    assert "MFU n/a" in line and "mem 1.50/2.00 reserved GiB" in line


def test_interval_meter_throughput_flops_and_mfu() -> None:
    meter = IntervalMeter(tokens_per_step=4096, flops_per_token=1e9, world_size=4, peak_tflops=2.0)
    for _ in range(4):
        meter.add(loss=2.0, step_time=0.5, data_time=0.1)
    meter.started -= 5.0  # pretend the interval took >= 5 s of wall clock (its steps sum to 2 s)
    record = meter.record(step=8, lr=1e-3, grad_norm=0.5, consumed_samples=64, seq_len=256, memory_gib=1.5)
    elapsed = 4 * 4096 / record["tokens_per_s"]
    assert 5.0 <= elapsed < 6.0  # the wall clock, not the steps' sum; a second's slack for a loaded machine
    assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 4)
    assert record["tflops_per_device"] == pytest.approx(record["tokens_per_s"] * 1e9 / 4 / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] / 2.0)
    assert (record["step"], record["loss"], record["step_time_s"], record["data_time_s"]) == (8, 2.0, 0.5, 0.1)
    assert (record["consumed_samples"], record["consumed_tokens"]) == (64, 64 * 256)
    assert meter.steps == 0 and meter.loss_sum == 0.0  # the next interval starts fresh


def test_meter_counts_the_attention_pairs_documents_leave() -> None:
    """With per-document masks a step's model FLOPs count the visible query-key pairs: a whole causal sample's
    pairs give the causal count; documents of S/16 tokens cut the attention term 16-fold."""
    model = ModelConfig(vocab_size=512, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=128, max_position_embeddings=4096)
    seq, batch = 4096, 2
    meters = {name: IntervalMeter.for_model(model, seq, batch, 1, 1.0) for name in ("causal", "one", "docs")}
    docs = 16 * (seq // 16) * (seq // 16 + 1) // 2
    for name, pairs in (("causal", None), ("one", seq * (seq + 1) // 2), ("docs", docs)):
        meters[name].add(2.0, 1.0, 0.0, attention_pairs=None if pairs is None else batch * pairs)
    records = {name: meter.record(1, 0.0, 0.0, 0, seq, 0.0) for name, meter in meters.items()}
    flops = {name: r["tflops_per_device"] * batch * seq / r["tokens_per_s"] for name, r in records.items()}  # TFLOP
    assert flops["one"] == pytest.approx(flops["causal"], rel=1e-3)
    dense = 6 * matmul_params(model) * batch * seq / 1e12
    assert (flops["docs"] - dense) == pytest.approx((flops["causal"] - dense) * (seq / 16 + 1) / (seq + 1), rel=1e-2)


def test_cpu_peak_memory_follows_the_high_water_mark() -> None:
    reset_peak_memory(torch.device("cpu"))
    before = peak_memory_gib(torch.device("cpu"))
    block = np.ones(64 * 2**20 // 8 * 4)  # 256 MiB, touched
    after = peak_memory_gib(torch.device("cpu"))
    del block
    assert before > 0 and after - before > 0.2


def test_wandb_mode_defaults_to_offline(monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_mode(None) == "online" and wandb_mode("offline") == "offline"


def test_writers_write_jsonl_and_console_lines(tmp_path) -> None:
    stream = io.StringIO()
    settings = SinkSettings(run_dir=tmp_path, run_name="demo-tp1-cp2-dp1-seq64", total_steps=20, config={"a": 1},
                            layout={"tp": 1, "cp": 2, "dp": 1, "seq_len": 64}, use_wandb=False, wandb_project="p")
    writers = MetricWriters(settings, stream=stream)
    meter = IntervalMeter(256, 1e6, 2, 0.2)
    for step in (10, 20):
        meter.add(3.0 - step / 10, 0.1, 0.01)
        writers.log(meter.record(step, 1e-3, 0.7, step * 4, 64, 0.5))
    writers.log({"kind": "eval", "step": 20, "loss": 1.5, "perplexity": 4.48})
    writers.message("hello")
    writers.close()
    records = read_records(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 10), ("train", 20), ("eval", 20)]
    assert all("loss" in r and "step" in r for r in records)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 10/20 [##########..........]  50% | loss 2.0000")
    assert "tok/s" in lines[0] and "MFU" in lines[0] and "GiB" in lines[0]
    assert lines[2].startswith("eval  step 20/20 | val loss 1.5000") and lines[3] == "[cp-train] hello"
    silent = MetricWriters(SinkSettings(run_dir=tmp_path / "other", run_name="x", total_steps=1), enabled=False)
    silent.log(records[0])
    assert not (tmp_path / "other").exists()


def _wandb_settings(run_dir: Path, mode: str) -> SinkSettings:
    layout = {"tp": 1, "cp": 1, "dp": 1, "seq_len": 8}
    return SinkSettings(run_dir=run_dir, run_name="run", total_steps=1, layout=layout, use_wandb=True,
                        wandb_project="p", wandb_mode=mode)


def test_writers_without_wandb_installed_log_to_jsonl_with_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    stream = io.StringIO()
    writers = MetricWriters(_wandb_settings(tmp_path, "offline"), stream=stream)
    writers.log({"kind": "eval", "step": 1, "loss": 1.5, "perplexity": 4.48})
    writers.close()
    assert writers.wandb_run is None and [r["step"] for r in read_records(tmp_path)] == [1]
    assert stream.getvalue().splitlines()[0] == ("[cp-train] wandb is not installed: metrics go to metrics.jsonl only "
                                                 "(pip install wandb, or set logging.wandb=false to silence this)")


def test_writers_when_wandb_cannot_start_say_what_to_set(tmp_path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")

    def no_key(**kwargs) -> None:
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    expected = (r"^wandb could not start its online run \(No API key configured\. .*\): set WANDB_API_KEY or run "
                r"`wandb login`, or use --wandb-mode offline or disabled$")
    with pytest.raises(InputError, match=expected):
        MetricWriters(_wandb_settings(tmp_path, "online"))


def test_writers_name_the_wandb_variable_wandb_refuses(tmp_path, monkeypatch) -> None:
    """``WANDB_MODE=`` (set but empty, as a script's ``export WANDB_MODE=`` leaves it) fails wandb's own settings
    validation (a pydantic error, not a ``wandb.Error``): one line naming the variable and its value."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "")
    expected = (r"^wandb refused its settings: WANDB_MODE='' \(mode: Input should be 'online', 'offline'.*\): fix or "
                r"unset the variable, or set logging.wandb=false$")
    with pytest.raises(InputError, match=expected):
        MetricWriters(_wandb_settings(tmp_path, "offline"))
    assert not list(tmp_path.glob("wandb/offline-run-*"))


def test_console_line_and_bar() -> None:
    assert progress_bar(5, 10, width=10) == "[#####.....]  50%"
    record = {"step": 3, "loss": 1.0, "lr": 1e-4, "grad_norm": 0.1, "tokens_per_s": 12345.0,
              "tokens_per_s_per_device": 6172.0, "tflops_per_device": 0.01, "mfu": 0.05, "step_time_s": 0.2,
              "data_time_s": 0.0, "peak_memory_gib": 0.3}
    line = console_line(record, 100, 0.0, 0)
    assert "12.3k tok/s (6.2k/dev)" in line and "MFU 5.0%" in line


def test_plot_writes_pngs(tmp_path) -> None:
    with open(tmp_path / METRICS_FILE, "w") as handle:
        for step in range(1, 11):
            handle.write(json.dumps({"kind": "train", "step": step, "loss": 5.0 / step, "tokens_per_s_per_device": 1e3,
                                     "tflops_per_device": 0.01, "mfu": 0.05}) + "\n")
        handle.write(json.dumps({"kind": "eval", "step": 10, "loss": 0.6}) + "\n")
    written = plot_main([str(tmp_path), "--out", str(tmp_path / "plots")])
    assert [p.name for p in written] == ["loss.png", "throughput.png", "memory.png"]
    assert all(p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)
    with pytest.raises(InputError, match="metrics.jsonl is missing: pass a run directory"):
        read_records(tmp_path / "plots")


def test_params_norm_is_the_full_parameters_norm(spawn_world, tmp_path) -> None:
    """Megatron-LM's ``--log-params-norm`` (``logging.params_norm``): each record's ``params_norm`` is the L2 norm of
    the parameters after its step: in one process, that of the parameters themselves; at tp 2 x FSDP over cp 2
    (TP's and FSDP's shards summed) and with DDP at cp 2, the one-process run's (the layouts train alike, within
    1e-6); the console line shows it. The runs end with a validation: FSDP then holds its sharded parameters
    again (none left gathered by the forward), and they equal the one-process run's."""
    from cp_train.parallel.mesh.state import run_with_parallel
    from tests import trainer_cases

    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    norms, ends = {}, {}
    for layout, fsdp in (((1, 1, 1), False), ((2, 2, 1), True), ((1, 2, 1), False)):
        run_dir = tmp_path / f"run-{layout}-{fsdp}"
        answer = spawn_world(layout[0] * layout[1]).run(
            run_with_parallel, layout, trainer_cases.train_layout, corpus, str(run_dir),
            {"train.steps": 2, "logging.interval": 1, "logging.params_norm": True, "parallel.fsdp": fsdp,
             "train.valid_interval": 2}, None,
            ("params",))[0]
        records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
        train = [record for record in records if record["kind"] == "train"]
        norms[layout] = [record["params_norm"] for record in train]
        ends[layout] = answer["end"]["params"]
        assert [r["step"] for r in records if r["kind"] == "eval"] == [2], records
        if layout == (1, 1, 1):
            full = torch.sqrt(sum(p.double().square().sum() for p in answer["end"]["params"].values())).item()
            assert len(norms[layout]) == 2 and abs(norms[layout][-1] - full) <= 1e-6 * full, (norms, full)
            assert f"| pnorm {full:.3f} |" in console_line(train[-1], 2, 0.0, 0)
    for layout in ((2, 2, 1), (1, 2, 1)):
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms[layout], norms[(1, 1, 1)], strict=True)), norms
        reference = ends[(1, 1, 1)]
        assert ends[layout].keys() == reference.keys(), layout
        for name, param in ends[layout].items():
            assert param.shape == reference[name].shape, (layout, name, param.shape)
            assert (param - reference[name]).norm() <= 1e-5 * reference[name].norm(), (layout, name)
