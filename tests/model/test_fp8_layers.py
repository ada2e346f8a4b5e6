"""``model.fp8_bf16_layers_at_start`` / ``_at_end`` (Megatron's --num-layers-at-start-in-bf16 and -at-end-): the
first and last blocks keep their linears in the compute dtype under ``model.fp8``. What converts, the one-line
errors, the MFU's FP8 FLOPs and the planner's mix of FP8 and bf16 blocks. Compiled mixed blocks: ``test_fp8.py``;
the trainer's wiring (FSDP2 over 3 ranks): ``tests/train/test_fp8_train.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cp_train.config.schema import ConfigError
from cp_train.config.sources import build_config
from cp_train.config.validate import validate
from cp_train.metrics.throughput import fp8_flops_per_token
from cp_train.model import GPTModel
from cp_train.parallel.tp.fp8 import Float8Matmul, convert_to_fp8, fp8_layers, fp8_unavailable
from tests.model_cases import global_batch, step, tiny_config
from tests.numerics import rel_err

CPU = torch.device("cpu")
if fp8_unavailable("tensorwise", CPU):  # the dev extra installs torchao
    pytest.skip(fp8_unavailable("tensorwise", CPU), allow_module_level=True)
BLOCK_LINEARS = ("attention.qkv", "attention.proj", "mlp.gate_up", "mlp.down")
KEEP = {"fp8_bf16_layers_at_start": 1, "fp8_bf16_layers_at_end": 1}


def test_the_first_and_last_blocks_keep_the_compute_dtype() -> None:
    """4 blocks, one kept at each end: blocks 1 and 2 convert (as ``cp_train.build`` converts them), blocks 0 and 3
    run ``F.linear``; the kept block 0 gives bitwise the fp32 model's first block, and the whole model lies
    between: closer to fp32 than the all-FP8 model, still not equal to it."""
    config = tiny_config(num_layers=4, fp8="tensorwise", **KEEP)
    assert config.fp8_blocks == range(1, 3) and dataclasses.replace(config, fp8="none").fp8_blocks == range(0)
    plain, mixed, every = GPTModel(tiny_config(num_layers=4)), GPTModel(config), GPTModel(tiny_config(num_layers=4))
    names = convert_to_fp8(mixed.layers, "tensorwise", CPU, prefix="layers.", indices=config.fp8_blocks)
    assert names == fp8_layers(mixed) == [f"layers.{i}.{n}" for i in (1, 2) for n in BLOCK_LINEARS]
    assert all(mixed.layers[i].get_submodule(n).linear_fn is F.linear for i in (0, 3) for n in BLOCK_LINEARS)
    assert isinstance(mixed.layers[1].mlp.down.linear_fn, Float8Matmul)
    assert convert_to_fp8(every.layers, "tensorwise", CPU, indices=range(0)) == []  # nothing to convert
    assert len(convert_to_fp8(every.layers, "tensorwise", CPU)) == 4 * len(BLOCK_LINEARS)

    outputs: dict[str, torch.Tensor] = {}
    for name, model in (("plain", plain), ("mixed", mixed)):
        model.layers[0].register_forward_hook(lambda _m, _i, out, name=name: outputs.update({name: out}))
    data = global_batch(tiny_config())
    results = {name: step(model, data) for name, model in (("plain", plain), ("mixed", mixed), ("every", every))}
    assert torch.equal(outputs["mixed"], outputs["plain"])
    mixed_error = rel_err(results["mixed"]["losses"], results["plain"]["losses"])
    assert 0 < mixed_error < rel_err(results["every"]["losses"], results["plain"]["losses"])


def _config(**model: object):  # noqa: ANN202
    return build_config([("test", {"model.vocab_size": 128, "data.eod_id": 0, "model.num_layers": 4,
                                   **{f"model.{k}": v for k, v in model.items()}})])


@pytest.mark.parametrize(("settings", "message"), [
    ({"fp8": "tensorwise", "fp8_bf16_layers_at_start": -1},
     "model: fp8_bf16_layers_at_start must be an integer >= 0, got -1"),
    ({"fp8": "rowwise", "fp8_bf16_layers_at_start": 2, "fp8_bf16_layers_at_end": 2},
     "model: fp8_bf16_layers_at_start 2 + fp8_bf16_layers_at_end 2 keep all 4 blocks out of FP8: lower them, or "
     "set fp8=none"),
])
def test_counts_that_leave_no_fp8_block_are_one_line_errors(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate(_config(**settings), 1)
    assert str(error.value) == message


def test_without_fp8_the_counts_are_ignored() -> None:
    """The planner's --precision bf16 sets model.fp8=none on a config that keeps blocks out of FP8."""
    config = _config(fp8_bf16_layers_at_start=3, fp8_bf16_layers_at_end=3)
    assert validate(config, 1) == 1 and config.model.fp8_blocks == range(0)


def test_the_mfu_counts_only_the_fp8_blocks_at_the_fp8_peak() -> None:
    every = tiny_config(num_layers=4, fp8="tensorwise")
    assert fp8_flops_per_token(dataclasses.replace(every, **KEEP)) == pytest.approx(fp8_flops_per_token(every) / 2)
    assert fp8_flops_per_token(dataclasses.replace(every, fp8_bf16_layers_at_end=3)) == fp8_flops_per_token(every) / 4


def test_the_planner_times_the_kept_blocks_at_bf16() -> None:
    """Llama-3.1-8B (32 blocks) with one kept at each end: the blocks' GEMMs take 30/32 of the FP8 time plus 2/32
    of bf16's, the casts 30/32 of all-FP8's; at bf16 the counts change nothing."""
    from bench.planner_published import run_config
    from cp_train.perf.inputs.hardware import load_hardware
    from cp_train.perf.inputs.runs import measured_runs
    from cp_train.perf.rates import DeviceRates
    from cp_train.perf.time_model import fp8_cast_seconds, fp8_share, gemm_seconds, matmul_seconds
    from cp_train.perf.workload import build_workload

    run = next(r for r in measured_runs() if r.key == "titan-8b-8k-fsdp8-fp8")
    hardware = load_hardware("h100-sxm")
    every = run_config(run, "none")
    mixed = dataclasses.replace(every, model=dataclasses.replace(every.model, **KEEP))
    bf16, fp8 = DeviceRates(hardware, "bf16"), DeviceRates(hardware, "fp8")
    work_every, work_mixed = build_workload(every, 8, 2), build_workload(mixed, 8, 2)
    assert (fp8_share(work_every, fp8), fp8_share(work_mixed, fp8), fp8_share(work_mixed, bf16)) == (1.0, 30 / 32, 0)
    expected = 30 / 32 * gemm_seconds(work_every, fp8) + 2 / 32 * gemm_seconds(work_every, bf16)
    assert matmul_seconds(work_mixed, fp8)[0] == pytest.approx(expected, rel=1e-12)
    assert gemm_seconds(work_every, fp8) < expected < gemm_seconds(work_every, bf16)
    mlp = 30 / 32 * gemm_seconds(work_every, fp8, mlp_only=True) + 2 / 32 * gemm_seconds(work_every, bf16, True)
    assert gemm_seconds(work_mixed, fp8, mlp_only=True) == pytest.approx(mlp, rel=1e-12)
    assert fp8_cast_seconds(work_mixed, fp8) == pytest.approx(tuple(30 / 32 * x for x in
                                                                    fp8_cast_seconds(work_every, fp8)))
    assert matmul_seconds(work_mixed, bf16) == matmul_seconds(work_every, bf16)



def test_the_planners_header_names_the_fp8_blocks() -> None:
    from cp_train.cli.plan import _linears

    config = _config(fp8="tensorwise", fp8_bf16_layers_at_end=1)
    assert _linears(config, "fp8") == "fp8 (tensorwise) linears in blocks 0-2 (1 of 4 in bf16)"
    assert _linears(_config(fp8="rowwise"), "fp8") == "fp8 (rowwise) linears"
    assert _linears(_config(fp8_bf16_layers_at_end=1), "bf16") == "bf16 linears"
