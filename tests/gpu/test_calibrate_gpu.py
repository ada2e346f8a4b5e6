"""``cp-train-plan --calibrate`` on a GPU (``cp_train/perf/calibrate.py``): a profile the planner reads and uses."""

from __future__ import annotations

from pathlib import Path

from bench.planner_published import run_config
from cp_train.perf.calibrate import write_profile
from cp_train.perf.inputs.hardware import load_hardware
from cp_train.perf.inputs.runs import measured_runs
from cp_train.perf.predict import predict
from cp_train.perf.rates import DeviceRates


def test_quick_gpu_calibration_writes_a_profile_the_planner_uses(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "gpu.yaml"
    written = write_profile(path, quick=True, log=lines.append)
    profile = load_hardware(path)
    assert profile == written and profile.name.endswith("-calibrated")
    assert any(line.startswith("bf16 GEMM") for line in lines)
    # a large bf16 GEMM reaches a real fraction of the peak; a tiny one far less
    assert 0.3 < profile.gemm_fraction(5e11) <= 1.0 and profile.gemm_fraction(5e7) < profile.gemm_fraction(5e11)
    for curve in profile.attention:
        fractions = [f for _, f in curve.points]
        assert all(0.02 < f <= 1.0 for f in fractions), curve
        assert fractions[-1] > fractions[0], curve  # longer calls amortise better
    assert 1.0 < profile.hbm_tb_s < 20.0
    assert 0.5 < profile.host_op_us < 200 and 0 <= profile.graph_build_ms < 5000
    run = next(r for r in measured_runs() if not r.attention_only and r.tp * r.cp * r.dp == 8)
    prediction = predict(run_config(run, "none"), 8, DeviceRates(profile), profile.peak_tflops(), profile.hbm_gib,
                         8.0)
    assert prediction.step_time_s > 0 and 0 < prediction.record()["mfu"]["causal_half"] < 1
