"""The planner (``cp_train.perf``, ``cp-train-plan``) against what the code it models does.

- Its attention work per rank equals the kernel area the CP attention executes (counted at the CPU kernel), and
  the bytes it puts on the wire equal the bytes the ring, all-gather and Ulysses code sends (``BYTES_SENT``),
  rank by rank, at cp 2 and 4 in every static layout.
- ``cp-train-plan`` prints a table and JSON lines with the documented keys, each figure with its range; it searches
  only layouts the trainer accepts, and bad input (a CPU config or profile among it) is one line naming what to
  change.
"""

from __future__ import annotations

import json
import re

import pytest

from cp_train.cli.plan import main as plan_main
from cp_train.config.schema import Config
from cp_train.model.config import ModelConfig
from cp_train.parallel.mesh.state import run_with_parallel
from cp_train.perf.workload import build_workload
from tests import planner_cases

SEQ = 64
CASES = [(2, "zigzag", "ring"), (2, "contiguous", "ring"), (4, "zigzag", "ring"), (4, "stripe", "ring"),
         (4, "contiguous", "ring"), (2, "zigzag", "allgather"), (4, "zigzag", "allgather"),
         (4, "stripe", "allgather"), (2, "zigzag", "ulysses"), (4, "zigzag", "ulysses")]


def _workload(cp: int, layout: str, algorithm: str, documents: tuple[int, ...] | None = None):  # noqa: ANN202
    config = Config()
    config.model = ModelConfig(vocab_size=64, num_layers=1, hidden_size=planner_cases.HEADS * planner_cases.DIM,
                               num_heads=planner_cases.HEADS, num_kv_heads=planner_cases.KV_HEADS,
                               max_position_embeddings=SEQ)
    config.data.seq_len, config.parallel.cp, config.parallel.dp = SEQ, cp, 1
    config.parallel.cp_layout, config.parallel.cp_algorithm = layout, algorithm
    config.train.micro_batch_size = config.train.global_batch_size = planner_cases.BATCH
    return build_workload(config, cp, 4, documents)


@pytest.mark.parametrize(("cp", "layout", "algorithm"), CASES, ids=lambda x: str(x))
def test_planned_work_and_bytes_equal_what_the_attention_runs(spawn_world, cp, layout, algorithm) -> None:
    work = _workload(cp, layout, algorithm)
    for answer in spawn_world(cp).run(planner_cases.count_attention, SEQ, layout, algorithm):
        steps = work.attention[answer["rank"]]
        area = sum(call.area for step in steps for call in step.calls) * work.attention_heads * work.batch
        assert answer["area"] == area, (answer, area)
        sent = answer["sent"]
        if algorithm == "ulysses":  # each all-to-all sends (cp-1)/cp of its input
            planned = sum(c.size * c.count for c in work.attention_collectives) * work.batch * (cp - 1) / cp
            assert sent == {"all_to_all": int(planned)}, (sent, planned)
            continue
        forward = sum(step.send_forward for step in steps) * work.batch
        backward = sum(step.send_backward for step in steps) * work.batch
        assert sum(sent.values()) == forward + backward, (sent, forward, backward)
        if algorithm == "ring":  # K/V hops (tag 0) forward and again backward; dK/dV hops (tag 1)
            assert sent.get(0, 0) == 2 * forward and sent.get(1, 0) == backward - forward, (sent, forward, backward)


@pytest.mark.parametrize(("sequence_parallel", "loss_chunk"), [(True, 8), (False, 0)])
def test_planned_tp_collectives_equal_what_the_model_issues(spawn_world, sequence_parallel, loss_chunk) -> None:
    """Every TP collective of a forward + backward (the blocks', the embedding's, the head's, the loss's), counted
    by kind and bytes at tp 2, equals the planner's per-layer list times the layers plus its list outside them."""
    config = Config()
    config.model = ModelConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=64, max_position_embeddings=16, loss_chunk_tokens=loss_chunk)
    config.data.seq_len, config.parallel.tp, config.parallel.dp = 16, 2, 1
    config.parallel.sequence_parallel = sequence_parallel
    config.train.micro_batch_size = config.train.global_batch_size = 2
    work = build_workload(config, 2, 4)
    planned: dict[str, list[int]] = {}
    for collectives, times in ((work.tp_collectives, config.model.num_layers), (work.tp_outside_collectives, 1)):
        for c in collectives:
            entry = planned.setdefault(c.kind, [0, 0])
            entry[0] += times * c.count
            entry[1] += times * c.count * c.size
    for seen in spawn_world(2).run(run_with_parallel, (2, 1, 1), planner_cases.count_tp_collectives, config):
        assert seen == planned, (seen, planned)


def test_json_lines_carry_both_flop_conventions_and_the_breakdown(capsys) -> None:
    assert plan_main(["llama3-8b", "--seq-len", "131072", "--gpus", "8", "--cp", "8", "--tp", "1", "--fsdp",
                      "--activation-checkpointing", "full", "--micro-batch", "1", "--cp-algorithm", "ring",
                      "--cp-layout", "zigzag", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert {"step_time_s", "tokens_per_s_per_gpu", "mfu", "tflops_per_gpu", "memory_gib", "fits",
            "breakdown_s"} <= record.keys()
    assert set(record["mfu"]) == set(record["tflops_per_gpu"]) == {"causal_half", "causal_full"}
    assert record["tflops_per_gpu"]["causal_full"] > record["tflops_per_gpu"]["causal_half"] > 0
    assert set(record["memory_gib"]) == {"parameters", "gradients", "optimizer", "gathered", "activations", "total"}
    assert set(record["breakdown_s"]) >= {"matmuls", "attention", "cp_comm", "tp_comm", "data_comm", "optimizer"}
    assert record["step_time_s"] == pytest.approx(sum(record["breakdown_s"].values()))
    assert 0 < record["mfu"]["causal_half"] < 1 and record["fits"] is True
    assert record["breakdown_s"]["host"] > 0
    low, high = record["tokens_per_s_per_gpu_range"]
    assert 0 < low < high and high / low <= 1.5
    step_low, step_high = record["step_time_s_range"]  # the same errors: time x throughput is the tokens per step
    assert step_low * high == pytest.approx(step_high * low) == pytest.approx(
        record["step_time_s"] * record["tokens_per_s_per_gpu"])
    assert set(record["tflops_per_gpu_range"]) == {"causal_half", "causal_full"}
    for convention, (lo, hi) in record["tflops_per_gpu_range"].items():
        assert lo / low == pytest.approx(record["tflops_per_gpu"][convention] / record["tokens_per_s_per_gpu"])
        assert hi / lo == pytest.approx(high / low)


def test_search_ranks_fitting_layouts_by_throughput_and_explains_the_best(capsys) -> None:
    assert plan_main(["llama3-8b", "--seq-len", "131072", "--gpus", "8", "--fsdp", "--micro-batch", "1",
                      "--cp-layout", "zigzag", "--json", "--top", "200"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    fits = [r["fits"] for r in records]
    assert fits[0] and fits == sorted(fits, reverse=True), "fitting layouts come first"
    speeds = [r["tokens_per_s_per_gpu"] for r in records if r["fits"]]
    assert speeds == sorted(speeds, reverse=True)
    assert {r["cp_algorithm"] for r in records} >= {"ring", "allgather", "ulysses"}
    assert all(r["tp"] * r["cp"] * r["dp"] == 8 for r in records)
    assert all(r["tokens_per_s_per_gpu_range"][0] < r["tokens_per_s_per_gpu_range"][1] for r in records)
    assert plan_main(["llama3-8b", "--seq-len", "131072", "--gpus", "8", "--cp", "8", "--tp", "1", "--fsdp",
                      "--micro-batch", "1", "--explain", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "where the time goes" in text and "bounded by" in text and "memory per GPU" in text
    assert "expected:" in text and "measured runs of regime large/long" in text and "titan-8b-128k-fsdp2-cp4" in text
    step = float(re.search(r"takes ([0-9.]+) s", text).group(1))
    check = re.search(r"CP check \(train.check_cp_every 1000\): ([0-9.]+) s per check .*, ([0-9.]+)% of", text)
    # a forward of the whole sample on one GPU: more than the step's share of it (1/3 over cp 8), a few steps at most
    assert check and step / 8 < float(check.group(1)) < 5 * step and float(check.group(2)) < 1, text


@pytest.mark.parametrize(("argv", "message"), [
    (["llama9-1b", "--seq-len", "8192", "--gpus", "8"], "llama3-8b"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--hardware", "tpu-v9"], "h100-sxm"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--tp", "3"], "tp"),
    (["llama3-8b", "--seq-len", "8190", "--gpus", "8", "--cp", "8"], "seq_len"),
    (["launch/configs/cpu-tiny.yaml", "--seq-len", "256", "--gpus", "2"], "predicts GPUs"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--attention-kernel", "fa9"], "flash2"),
    (["--calibrate", "gpu.yaml"], "has none"),
    (["llama3-8b", "--seq-len", "0", "--gpus", "8"], "argument --seq-len: must be a positive integer, got '0'"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "-8"], "argument --gpus: must be a positive integer"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--gpus-per-node", "0"], "argument --gpus-per-node"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--global-batch-tokens", "0"], "--global-batch-tokens"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--reserve-fraction", "1"], "below 1"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--reserve-gib", "100"], "of h100-sxm keep 104 GiB, all of"),
    (["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--dp", "3"], "--tp/--cp/--dp as given leave no tp*cp*dp = 8"),
])
def test_bad_input_is_one_line_naming_the_fix(capsys, argv, message) -> None:
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_cpu_profile_is_one_line_pointing_at_the_dry_run(tmp_path, capsys) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text("name: cpu-calibrated\ncompute_dtype: fp32\ncpu: {cores: 2}\n")
    assert plan_main(["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CPU profile" in err and "--dry-run" in err, err


def test_a_hardware_file_missing_a_constant_names_it(tmp_path, capsys) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text("name: mine\nbf16_tflops: 100\n")
    assert plan_main(["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("mine" in err or "gpu.yaml" in err), err


def test_every_run_checks_the_planner(spawn_world, tmp_path) -> None:
    """With a hardware profile the setup record carries the planner's prediction for the run's own layout, the
    final line says measured / predicted, and an MFU above 100% (a peak set far too low) is flagged once."""
    from cp_train.parallel.mesh.state import run_with_parallel
    from tests import trainer_cases

    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    overrides = {"logging.hardware_profile": "h100-sxm", "logging.cpu_peak_tflops": 1e-9, "train.steps": 4}
    answer = spawn_world(2).run(run_with_parallel, (1, 2, 1), trainer_cases.train_layout, corpus,
                                str(tmp_path / "run"), overrides)[0]
    prediction = answer["setup"]["prediction"]
    assert prediction["hardware"] == "h100-sxm" and prediction["step_time_s"] > 0 and prediction["fits"]
    assert prediction["documents_per_sample"] > 1  # the run's own packed documents, from its first sample
    messages = answer["messages"]
    assert sum("measured MFU" in m and "above 100%" in m for m in messages) == 1, messages
    assert any(m.startswith("step time") and "predicted by the planner on h100-sxm" in m for m in messages), messages


def test_a_gpu_run_compares_its_peak_memory_with_the_dry_run() -> None:
    """On a GPU the final lines add the peak allocated memory (max over ranks, the largest logged) against the dry
    run's plan in the prediction; a CPU run's peak (RSS, the runtime's too) is not compared."""
    import torch

    from cp_train.config.sources import build_config
    from cp_train.perf.run_check import PlannerCheck

    config = build_config([("test", {"model.vocab_size": 1024, "model.num_layers": 2, "model.hidden_size": 256,
                                     "model.num_heads": 4, "model.num_kv_heads": 2, "model.ffn_hidden_size": 512,
                                     "data.seq_len": 4096, "data.eod_id": 0, "parallel.cp": 1,
                                     "logging.hardware_profile": "h100-sxm"})])
    for device, compared in (("cuda", True), ("cpu", False)):
        check = PlannerCheck(config, 1, torch.device(device), 989.0, "test")
        planned = check.prediction["memory_gib"]
        for peak in (0.5 * planned, 1.25 * planned, 0.75 * planned):  # the largest logged peak is the run's
            check.observe({"step_time_s": 0.1, "mfu": 0.3, "peak_memory_max_gib": peak})
        lines = check.summary()
        assert lines[0].startswith("step time 0.1 s measured")
        memory = f"peak memory {1.25 * planned:.3g} GiB allocated / {planned:.3g} GiB planned by the dry run = 1.25"
        assert (lines[1:] == [memory]) is compared, lines
