"""``bench/step_profile.py`` on the trainer's own scheduled profile (``--profile``), on CPU; the busy time read from
the trace (``cp_train/metrics/trace.py``)."""

from __future__ import annotations

import gzip
import json
import os
from types import SimpleNamespace

import pytest
import torch

from bench import step_profile
from cp_train.metrics.trace import copies, summary, union_seconds


def test_the_union_of_intervals_counts_overlaps_once() -> None:
    busy, span = union_seconds([(0, 10), (5, 15), (20, 30), (22, 25), (40, 41)])
    assert busy == pytest.approx(26e-6) and span == pytest.approx(41e-6)
    assert union_seconds([]) == (0.0, 0.0)


def _device_event(name: str, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def test_the_annotations_on_the_device_timeline_are_not_busy_time() -> None:
    """On CUDA the scheduled profile draws ``ProfilerStep#N`` (and record_function ranges) on the device's timeline
    over the whole step: counted as a kernel it made every step look busy (an H200 trace: 0.1% idle where its kernels
    leave 1.3%). Two kernels with a 20 us gap under a step marker and a named range: 20% idle, no annotation kind."""
    events = [_device_event("ProfilerStep#8", 0, 100, annotation=True), _device_event("## forward ##", 0, 60, True),
              _device_event("nvjet_sm90_gemm", 0, 40), _device_event("flash_fwd_kernel", 60, 100)]
    record = summary(events, cuda=True, steps=1)
    assert record["busy_s"] == pytest.approx(80e-6) and record["idle_fraction"] == pytest.approx(0.2)
    assert record["by_kind_s"] == {"matmul": 0.0, "attention": 0.0}  # rounded to 0.1 ms; the annotations absent
    marker_only = [_device_event("ProfilerStep#9", 0, 100)] + events[2:]  # a build without is_user_annotation
    assert summary(marker_only, cuda=True, steps=1)["idle_fraction"] == pytest.approx(0.2)


def test_fp8_gemms_and_scales_are_read_apart() -> None:
    """With FP8 linears the record adds ``fp8_s``: the kernels ``aten::_scaled_mm`` launched (a compiled graph's
    too) and the dynamic scales' absolute-maximum reductions (by kernel name: torchao's ``max(abs(x))``); a bf16
    step (no ``_scaled_mm``) has none, and the loss's ``amax`` kernels, without ``abs``, are not scales."""
    graph = _op("## Call CompiledFxGraph abc ##", None, [])
    kernels = [_device_event("nvjet_fp8_gemm", 0, 30), _device_event("triton_red_fused_abs_max_0", 30, 40),
               _device_event("triton_red_fused__log_softmax_amax_1", 40, 45), _device_event("nvjet_bf16", 45, 50)]
    fp8 = [*kernels, _op("aten::_scaled_mm", graph, [], (30.0,)), _op("aten::mm", graph, [], (5.0,))]
    record = summary(fp8, cuda=True, steps=1)
    assert record["fp8_s"] == {"gemm": pytest.approx(30e-6, abs=1e-4), "scales": pytest.approx(10e-6, abs=1e-4)}
    assert "fp8_s" not in summary([*kernels, _op("aten::mm", graph, [], (5.0,))], cuda=True, steps=1)
    assert "fp8_s" not in summary(fp8, cuda=False, steps=1)
    from cp_train.metrics.trace import fp8_seconds
    assert fp8_seconds(fp8, kernels) == {"gemm": pytest.approx(30e-6), "scales": pytest.approx(10e-6)}


def _op(name: str, parent: SimpleNamespace | None, shapes: list, kernel_us: tuple[float, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(name=name, cpu_parent=parent, input_shapes=shapes, device_type=torch.autograd.DeviceType.CPU,
                           thread=0, time_range=SimpleNamespace(start=0, end=1, elapsed_us=lambda: 1),
                           kernels=[SimpleNamespace(duration=us) for us in kernel_us])


def test_copies_are_grouped_by_op_shapes_and_region() -> None:
    """The copy ops' device time by (op, input shapes, the outermost op below the step marker): two copies of one
    shape in one compiled graph add up; another shape, another region and a non-copy op are apart or left out."""
    step = _op("ProfilerStep#8", None, [])
    graph = _op("## Call CompiledFxGraph abc ##", step, [])
    backward = _op("autograd::engine::evaluate_function: CompiledFunctionBackward", step, [])
    events = [step, graph, backward,
              _op("aten::copy_", graph, [[4, 8], [4, 8]], (300.0,)),
              _op("aten::copy_", graph, [[4, 8], [4, 8]], (200.0,)),
              _op("aten::copy_", _op("aten::to", backward, []), [[2, 2], [2, 2]], (100.0,)),
              _op("aten::mm", graph, [[4, 8], [8, 4]], (900.0,)), _op("aten::copy_", graph, [[1]], ())]
    found = copies(events)
    assert found == [("aten::copy_ [[4, 8], [4, 8]] in ## Call CompiledFxGraph abc ##", 0.5),
                     ("aten::copy_ [[2, 2], [2, 2]] in " + backward.name[:60], 0.1)]


def test_a_scheduled_profile_of_real_steps(tmp_path, capsys) -> None:
    """Steps 3 and 4 recorded after one skipped and one warm-up: the busy time is most of each step on CPU (the
    loop's own ops), the idle fraction a fraction, the step a real step's length; the trace names the run's steps;
    the record is in metrics.jsonl and on the console."""
    code, records, keys = step_profile.run(
        ["--config", "launch/configs/cpu-tiny.yaml", "--cp-size", "1", "--train-steps", "5", "--set",
         f"logging.dir={tmp_path}", "--set", "schedule.warmup_steps=1", "--set", "model.num_layers=1", "--set",
         "logging.wandb=false", "--log-interval", "5"], skip=1, active=2)
    assert code == 0
    (record,) = records
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # the one-process world leaves nothing behind
    assert record["device"] == "cpu" and record["profiled_steps"] == [3, 4] and record["step"] == 4
    assert record["steps"] == 2 and record["step_s"] > 0.01
    assert 0.5 * record["step_s"] < record["busy_s"] <= record["step_s"] and 0 <= record["idle_fraction"] < 0.5
    assert any("attention" in name for name, _ in record["longest_ms"])
    trace = json.load(gzip.open(tmp_path / "profile" / "rank0-steps3-4.json.gz"))
    assert sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}) == [
        "ProfilerStep#3", "ProfilerStep#4"]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["profiled_steps"] for r in logged if r["kind"] == "profile"] == [[3, 4]]
    out = capsys.readouterr().out
    assert "PROFILE {" in out and "profile of steps 3-4 on rank 0: " in out and "idle" in out
    assert keys.new_by_step(5)[0] == 0 and sum(keys.new_by_step(5)) == len(keys.first_seen) > 0
