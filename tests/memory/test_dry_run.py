"""The dry run against real training steps: the planned peak within 15% of the measured one (live tensor bytes,
``bench/dry_run_check.py``) on the tiny trainer run; sequence parallelism halves the block inputs (planned and
measured); ``parallel.fsdp_reduce: auto`` picks what fits; the "to fit" hints name the settings that shrink the
larger part. The cpu-tiny table is ``python -m bench.dry_run_check`` (docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import dry_run_check
from bench.tensor_bytes import LiveTensorBytes
from cp_train.config.schema import OptimizerConfig
from cp_train.config.sources import load_config
from cp_train.memory import dry_run
from cp_train.memory.dry_run import GIB, RankMemory, memory_plan
from cp_train.memory.dry_run_report import report, shrink_hint
from cp_train.memory.fsdp_reduce import resolve_fsdp_reduce, with_reduce
from cp_train.model.family import get_model_family
from cp_train.optim import build_optimizer
from cp_train.parallel.mesh.state import ParallelDims, run_with_parallel
from tests import dry_run_cases, trainer_cases

GPU_8B = "launch/configs/gpt-8b-128k-cp8.yaml"
CASES = {  # (tp, cp, dp) and overrides of the tiny run (2 micro-batches per step at dp 1)
    "cp2-ring-none": {},
    "cp2-allgather-full": {"parallel.cp_algorithm": "allgather", "model.activation_checkpointing": "full"},
    "cp2-ulysses-selective": {"parallel.cp_algorithm": "ulysses", "model.activation_checkpointing": "selective"},
    "cp2-fsdp-per_microbatch": {"parallel.fsdp": True, "parallel.fsdp_reduce": "per_microbatch"},
    "cp2-fsdp-auto": {"parallel.fsdp": True},  # auto: per_step on CPU
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def test_live_tensor_bytes_counts_storages_once_until_freed() -> None:
    """Views share their storage's count; a freed storage leaves it; an in-place resize (FSDP2's) re-counts it."""
    before, resize = torch.zeros(1000), torch.UntypedStorage.resize_
    tracker = LiveTensorBytes()
    tracker.track([before, before[:10]])
    with tracker:
        a = torch.ones(500)
        view = a[:100]
        del a
        b = torch.empty(250)
        b.untyped_storage().resize_(0)
        b.untyped_storage().resize_(4000)
        del view
    assert tracker.current == 4000 + 4000 and tracker.overall_peak == 4000 + 2000 + 4000, vars(tracker)
    assert torch.UntypedStorage.resize_ is resize  # restored on exit


def test_live_tensor_bytes_counts_the_outputs_of_gloo_collectives(spawn_world) -> None:
    for counted in spawn_world(2).run(run_with_parallel, (1, 2, 1), dry_run_cases.collective_output_bytes):
        assert counted == {"all_gather": 2**20, "all_to_all": 2**19}, counted


@pytest.mark.parametrize("name", list(CASES))
def test_the_planned_peak_is_within_15_percent_of_the_measured(spawn_world, corpus, tmp_path, name) -> None:
    config = trainer_cases.tiny_config(corpus, str(tmp_path), ParallelDims(tp=1, cp=2, dp=1), **CASES[name])
    record = dry_run_check.compare(spawn_world(2), config, name)
    assert abs(record["ratio"] - 1) <= 0.15, record
    if config.parallel.fsdp:  # the trainer resolves auto as the dry run does: per_step on CPU
        assert record["fsdp_reduce"] == (config.parallel.fsdp_reduce.replace("auto", "per_step")), record


def test_sequence_parallelism_halves_the_block_inputs(spawn_world, corpus, tmp_path) -> None:
    """At tp 2 each rank's block inputs (what full checkpointing keeps) are half, measured and in the dry run."""
    measured, planned = {}, {}
    for sp in (True, False):
        config = trainer_cases.tiny_config(corpus, str(tmp_path / str(sp)), ParallelDims(tp=2, cp=1, dp=1), **{
            "parallel.sequence_parallel": sp, "model.activation_checkpointing": "full"})
        measured[sp] = spawn_world(2).run(run_with_parallel, (2, 1, 1), dry_run_cases.block_input_bytes, config)[0]
        _, _, activations, assumed = memory_plan(config, 2)
        assert assumed["sequence_parallel"] is sp
        planned[sp] = activations["block_input"]
    assert len(measured[True]) == 2 * trainer_cases.TINY_MODEL["num_layers"]  # two micro-batches
    assert all(on * 2 == off for on, off in zip(measured[True], measured[False], strict=True)), measured
    assert planned[True] * 2 == planned[False] == measured[False][0], (planned, measured)


def _8b(*overrides: str):  # noqa: ANN202
    return load_config(GPU_8B, overrides=list(overrides))


def test_fsdp_reduce_auto_is_per_step_where_it_fits_else_per_microbatch() -> None:
    """8 micro-batches per step (8B, cp 8): per_step keeps every parameter's unsharded fp32 gradient."""
    config = _8b("train.global_batch_size=8")
    needs = {mode: memory_plan(with_reduce(config, mode), 8, only=[0])[1][0].total_bytes / GIB
             for mode in ("per_step", "per_microbatch")}
    assert needs["per_step"] > needs["per_microbatch"] + 20, needs  # 4 B x 8.0 B parameters x 7/8
    roomy, tight = needs["per_step"] + 1, (needs["per_step"] + needs["per_microbatch"]) / 2
    assert resolve_fsdp_reduce(config, 8, roomy)[0] == "per_step"
    choice, why = resolve_fsdp_reduce(config, 8, tight)
    assert choice == "per_microbatch" and why.startswith("per_step needs"), why
    assert resolve_fsdp_reduce(_8b("train.global_batch_size=8", "parallel.backend=gloo"), 8, tight)[0] == "per_step"
    assert resolve_fsdp_reduce(_8b(), 8, 1.0) == ("per_step", "one micro-batch per step: nothing accumulates")
    assert resolve_fsdp_reduce(_8b("parallel.fsdp_reduce=per_step"), 8, tight) == ("per_step", "set in the config")
    text = report(config, 8, tight + 10, "8b", reserve_gib=10).text.splitlines()
    assert text[1].startswith("parallel.fsdp_reduce auto: per_microbatch (per_step needs"), text[1]
    assert text[-1].startswith("fits:"), text[-1]


def test_tensorwise_fp8_gathers_the_block_linears_at_one_byte() -> None:
    """8B, cp 8, FSDP: a block's backward holds two gathered blocks; tensorwise gathers their linear weights in FP8
    (1 byte, not bf16's 2), rowwise in bf16 (compiled, both keep less activation memory than bf16); over 24 ranks
    (dp 3) only the q/k/v weight (6,144 rows) splits evenly, and the others gather in bf16."""
    linears = {x.name: x.in_features * x.out_features for x in get_model_family("llama").block_linears(_8b().model)}
    plans = {fp8: memory_plan(_8b(f"model.fp8={fp8}"), 8, only=[0])[1][0] for fp8 in ("none", "tensorwise", "rowwise")}
    assert {plan.phase for plan in plans.values()} == {"block"}, plans
    assert plans["none"].gathered_bytes - plans["tensorwise"].gathered_bytes == 2 * sum(linears.values()), plans
    assert plans["rowwise"].gathered_bytes == plans["none"].gathered_bytes, plans
    # compiled (the config's), FP8 linears of either recipe keep nothing of their inputs: cast again in the backward
    assert plans["rowwise"].activation_bytes == plans["tensorwise"].activation_bytes < plans["none"].activation_bytes
    uneven = [memory_plan(_8b(f"model.fp8={fp8}", "train.global_batch_size=3"), 24, only=[0])[1][0]
              for fp8 in ("none", "tensorwise")]
    assert uneven[0].gathered_bytes - uneven[1].gathered_bytes == 2 * linears["qkv"], (uneven, linears)


def test_the_hints_name_micro_batches_the_fsdp_reduction_checkpointing_and_sequence_parallelism() -> None:
    config = _8b("train.global_batch_size=8", "parallel.fsdp_reduce=per_step")
    worst = memory_plan(config, 8, only=[0])[1][0]
    hint = report(config, 8, 40.0, "8b", reserve_gib=3).text.splitlines()[-1]
    assert hint.startswith("to fit: parallel.fsdp_reduce=per_microbatch (no unsharded gradients"), hint
    assert "fewer, larger micro-batches (train.micro_batch_size=8:" in hint, hint
    assert worst.state_bytes + worst.gathered_bytes > worst.activation_bytes  # the state's hints come first
    tp2 = _8b("parallel.tp=2", "parallel.sequence_parallel=false", "model.activation_checkpointing=none",
              "train.micro_batch_size=2", "train.global_batch_size=2")
    activations = dataclasses.replace(worst, activation_bytes=10 * worst.total_bytes)
    hint = shrink_hint(tp2, activations, accumulation=1)
    assert hint.startswith("parallel.sequence_parallel=true (the residual stream and the norms hold 1/tp"), hint
    assert "model.activation_checkpointing=selective" in hint, hint
    assert "train.micro_batch_size=1 (activations scale with it)" in hint, hint
    assert "parallel.sequence_parallel" not in shrink_hint(_8b("parallel.tp=2"), activations)  # on by default


@pytest.mark.parametrize("implementation", ["auto", "foreach"])
def test_the_optimizer_state_is_what_adamw_makes(implementation: str) -> None:
    """The dry run's optimizer bytes (from a probe per number of dims) are the bytes of the state torch's AdamW
    makes on CPU for parameters of every kind the runs hold: matrices, vectors, empty FSDP shards, a scalar."""
    shapes = [torch.Size(s) for s in [(4, 6), (6,), (0, 6), (0,), (), (2, 3, 5), (7, 1)]]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.ones_like(param)
    config = OptimizerConfig(implementation=implementation)
    adamw = build_optimizer(torch.nn.ParameterList(params), config, torch.device("cpu"))
    adamw.step()
    made = sum(value.numel() * value.element_size() for state in adamw.state.values() for value in state.values()
               if torch.is_tensor(value))
    assert made == dry_run.optimizer_state_bytes(config, shapes) == 8 * sum(s.numel() for s in shapes) + 4 * len(shapes)


def test_rank_memory_totals() -> None:
    memory = RankMemory(0, 1, 2, 3, 4, 5, "block")
    assert (memory.state_bytes, memory.total_bytes) == (6, 15)


@pytest.mark.parametrize(("chunks", "gated"), [(1, False), (1, True), (2, False)])
def test_the_mlp_backward_term_is_the_measured_one(chunks: int, gated: bool) -> None:
    """What an MLP's backward holds on top of what its forward kept (live tensor bytes, 512 tokens, ffn 256 against
    hidden 16, so the ``[n, ffn]`` tensors are all that count): the eager ``swiglu`` node one ``[n, ffn]``
    temporary, ``gated_silu`` run eager (FP8's path) four, a checkpointed slice its recompute and one."""
    import torch.nn.functional as F

    from cp_train.memory.activations import mlp_backward, swiglu_temporaries
    from cp_train.model.config import ModelConfig
    from cp_train.model.mlp import MLP
    from cp_train.parallel.cp.algorithms.costs import Shapes

    config = ModelConfig(vocab_size=64, num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=2, ffn_hidden_size=256,
                         max_position_embeddings=512, mlp_chunks=chunks)
    mlp = MLP(config, 0)
    if gated:  # a layer matmul other than F.linear (FP8's) takes gated_silu
        mlp.gate_up.linear_fn = lambda x, w, bias=None: F.linear(x, w, bias)
    x = torch.randn(1, 512, 16, requires_grad=True)
    tracker = LiveTensorBytes()
    tracker.track([*mlp.parameters(), x])
    with tracker:
        y = mlp(x)
        grad = torch.ones_like(y)
        tracker.new_phase("backward")
        kept = tracker.current
        y.backward(grad)
        tracker.new_phase("end")
    shapes = Shapes(512, 16, 2, 2, 8, 256, 64, 4, 4, swiglu_temps=swiglu_temporaries(gated, compiled=False))
    ratio = (tracker.peaks["backward"] - kept) / mlp_backward(shapes, chunks)
    assert 1.0 <= ratio <= 1.1, ratio


def test_fp8_linears_keep_what_the_plan_says(spawn_world, corpus, tmp_path) -> None:
    """Tensorwise FP8 linears keep FP8 casts of their inputs and weights (1 byte) where fp32 ones kept the tensors
    themselves; rowwise keeps what fp32 keeps (torchao casts per GEMM). The change each makes to the peak, measured
    on the tiny run without checkpointing (live tensor bytes), is the plan's within 10%."""
    records = {}
    for fp8 in ("none", "tensorwise", "rowwise"):
        config = trainer_cases.tiny_config(corpus, str(tmp_path / fp8), ParallelDims(tp=1, cp=2, dp=1),
                                           **{"model.fp8": fp8, "data.seq_len": 64})
        records[fp8] = dry_run_check.compare(spawn_world(2), config, fp8)
    change = {fp8: {kind: records[fp8][kind] - records["none"][kind] for kind in ("planned", "measured")}
              for fp8 in ("tensorwise", "rowwise")}
    assert change["tensorwise"]["measured"] < 0, records  # FP8 inputs kept in place of fp32 ones
    assert abs(change["tensorwise"]["planned"] / change["tensorwise"]["measured"] - 1) <= 0.1, change
    assert change["rowwise"] == {"planned": 0, "measured": 0}, change


def test_compiled_blocks_keep_what_inductors_partition_keeps() -> None:
    """What a compiled block's backward receives (AOTAutograd's min-cut partition, Inductor's): bf16 linears keep
    their QKV, gate/up and down inputs and autocast's weight copies, the block the output projection's bf16 output
    (not the fp32 stream after the attention) and bf16 casts of the rope tables; tensorwise FP8 linears (torchao's
    real ``_scaled_mm`` on CPU) none of the linears' inputs, cast again in the backward (from the block's input, the
    norms' scales and the gate/up output, which both keep, and saved scales). Checkpointed, full keeps the block's
    input and selective its input and the attention's output and lse (q, k, v recomputed with the QKV side). Each
    bf16 block's plan is the graph's to the byte, and so is the plan's difference under FP8."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from cp_train.memory.activations import block_terms, shapes_of
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel
    from cp_train.parallel.tp.fp8 import Float8Matmul, float8_config
    from tests.model_cases import global_batch

    config = ModelConfig(vocab_size=128, num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=192, max_position_embeddings=128)
    tokens, kept = 128, {}
    for mode, fp8 in (("none", False), ("none", True), ("selective", False), ("full", False)):
        torch._dynamo.reset()
        model, saved = GPTModel(dataclasses.replace(config, activation_checkpointing=mode)), []

        def record(graph, inputs, saved=saved):  # the backward's inputs but the tangents and the block's own inputs
            saved.extend(node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"
                         and not node.name.startswith(("tangents", "primals")))
            return graph

        block = model.layers[0]
        if fp8:
            matmul = Float8Matmul(float8_config("tensorwise", emulate=False))
            for linear in (block.attention.qkv, block.attention.proj, block.mlp.gate_up, block.mlp.down):
                linear.linear_fn = matmul
        backend = aot_autograd(fw_compiler=lambda graph, inputs: graph, bw_compiler=record,
                               partition_fn=min_cut_rematerialization_partition)
        block._checkpointed = torch.compile(block._checkpointed, backend=backend, fullgraph=True)
        batch = global_batch(config, seq=tokens, batch=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch["tokens"], batch["positions"], batch["labels"])
        loss.float().sum().backward()
        kept[mode, fp8] = sum(t.nbytes for t in saved if isinstance(t, torch.Tensor) and t.dim())  # scales aside
    weights = sum(p.numel() for name, p in model.layers[0].named_parameters() if p.dim() == 2)
    shapes = {mode: shapes_of(dataclasses.replace(config, fp8="tensorwise"), tokens, 1, 1, 2, 4, cuda=True,
                              compiled=True, fp8_keeps=mode) for mode in ("kept", None)}  # None: the dry run's own
    planned = (block_terms(config, shapes["kept"])[1] - block_terms(config, shapes[None])[1]) + 2 * weights
    assert kept["none", False] - kept["none", True] == planned > 0, (kept, planned)
    block_input = tokens * config.hidden_size * 4  # a primal input of the graph, the plan's first term
    bf16 = shapes_of(config, tokens, 1, 1, 2, 4, cuda=True, compiled=True)
    for mode, copies in (("none", 2 * weights), ("selective", 0), ("full", 0)):  # checkpointed: weights recast
        planned = block_terms(dataclasses.replace(config, activation_checkpointing=mode), bf16)[1] + copies
        assert kept[mode, False] + block_input == planned, (mode, kept)
