"""``bench/fp8.py`` runs on CPU at a toy shape (``--tiny``: a few eager steps, torchao's emulation), so the GPU
benchmark is not first run on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from bench import fp8
from cp_train.parallel.tp.fp8 import fp8_unavailable

if fp8_unavailable("tensorwise", torch.device("cpu")):  # the dev extra installs torchao
    pytest.skip(fp8_unavailable("tensorwise", torch.device("cpu")), allow_module_level=True)


def test_fp8_benchmark_smoke_run(tmp_path, capsys) -> None:
    records = fp8.main(["--tiny", "--out", str(tmp_path), "--hardware", "h200"])
    assert [r["variant"] for r in records] == ["none", "tensorwise", "rowwise"]
    assert [r["fp8_linears"] for r in records] == [0, 8, 8]  # 2 blocks x 4 linears (gate and up one)
    assert all(r["steps"] == 3 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in records)
    assert records[0]["speedup_vs_bf16"] == 1.0 and records[0]["mfu_fp8_peak"] == records[0]["mfu"]
    assert all(0 < r["mfu_fp8_peak"] < r["mfu"] for r in records[1:])  # the FP8 linears at twice the peak
    assert all(abs(r["loss_vs_bf16"]) < 0.01 for r in records)
    # the planner's prediction of each run (on the H200 profile, planned as FP8 where the linears are)
    assert all(r["planned_tokens_per_s"] > 0 for r in records) and records[0]["planned_speedup_vs_bf16"] == 1.0
    bf16, tensorwise, rowwise = (r["planned_tokens_per_s"] for r in records)
    assert bf16 < rowwise < tensorwise, (bf16, rowwise, tensorwise)  # rowwise pays more casts than tensorwise
    assert all(r["measured_vs_planned"] > 1 for r in records)  # a CPU is slower than an H200
    assert all(r["planned_memory_gib"] > 0 for r in records)  # the dry run's plan beside the measured peak
    out = capsys.readouterr().out
    assert "MFU (fp8 peak)" in out and "speedup" in out and "step measured/planned" in out


def test_each_variant_in_its_own_process(tmp_path, capsys, monkeypatch) -> None:
    """``--processes each`` (the default on CUDA, where a second compiled run in one process crashed): the child
    runs' records come back through their files and are compared as in one process; bf16's run in a fresh process
    lands on the same loss as in this one (the seed is the run's); a child that fails is reported, the rest go on."""
    records = fp8.main(["--tiny", "--out", str(tmp_path), "--processes", "each", "--variants", "none", "tensorwise",
                        "--set", "model.num_layers=1"])  # the override reaches the children: one block's 4 linears
    assert [r["variant"] for r in records] == ["none", "tensorwise"] and records[0]["speedup_vs_bf16"] == 1.0
    assert abs(records[1]["loss_vs_bf16"]) < 0.01 and records[1]["fp8_linears"] == 4
    # --baseline: a later run compares with that bf16 record, not running bf16 again (the tensorwise run's loss
    # against it as against a bf16 run in the same command)
    again = fp8.main(["--tiny", "--out", str(tmp_path / "later"), "--processes", "one", "--variants", "tensorwise",
                      "--set", "model.num_layers=1", "--baseline", str(tmp_path / "none.record.json")])
    assert [r["variant"] for r in again] == ["none", "tensorwise"] and again[0]["speedup_vs_bf16"] == 1.0
    assert again[1]["loss_vs_bf16"] == pytest.approx(records[1]["loss_vs_bf16"], abs=1e-6)
    for bad in (tmp_path / "missing.json", tmp_path / "tensorwise.record.json"):
        with pytest.raises(SystemExit, match="^bench.fp8 --baseline .*(cannot read|not a bf16)"):
            fp8.main(["--tiny", "--out", str(tmp_path), "--variants", "tensorwise", "--baseline", str(bad)])
    longer = json.loads((tmp_path / "none.record.json").read_text()) | {"steps": 100, "seq_len": 16384}
    (tmp_path / "longer.json").write_text(json.dumps(longer))
    with pytest.raises(SystemExit, match="^bench.fp8 --baseline .*100 steps of 16384 tokens and this one 3 of 128"):
        fp8.main(["--tiny", "--out", str(tmp_path), "--variants", "tensorwise", "--baseline",
                  str(tmp_path / "longer.json")])
    monkeypatch.setattr(fp8.sys, "executable", "false")  # the child exits 1 at once
    records = fp8.main(["--tiny", "--out", str(tmp_path), "--processes", "each", "--variants", "none", "rowwise"])
    assert records == []
    assert "bench.fp8 none: its process failed with exit 1" in capsys.readouterr().out


def test_a_fast_variant_is_its_recipe_with_every_gemm_accumulating_fast(tmp_path) -> None:
    """``tensorwise-fast``: ``model.fp8`` tensorwise with ``model.fp8_fast_accum`` all; the plain variants keep the
    recipe's own (the output GEMM only) and do not set the key (no note that it does nothing under bf16)."""
    args = fp8.argparse.Namespace(fsdp=False, seq=128, steps=3, eager=True, interval=1, hardware=None, tiny=True,
                                  overrides=[])
    fast = fp8.run_config(args, "tensorwise-fast", tmp_path)
    assert (fast.model.fp8, fast.model.fp8_fast_accum) == ("tensorwise", "all")
    plain = fp8.run_config(args, "none", tmp_path)
    assert (plain.model.fp8, plain.model.fp8_fast_accum) == ("none", "output")
    assert "model.fp8_fast_accum" not in plain.explicit_keys
