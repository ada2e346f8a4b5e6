"""The data-parallel wrappers on the tiny trainer run at (1, 2, 1): gradient accumulation communicates only
after the last micro-batch (FSDP2 and DDP), ZeRO-2 gathers each block once per step, and bf16 runs compute
in bf16 with fp32 master weights and gradients; the dry run of the shipped 8B config fits 8 x 80 GB.

Loss and gradient equality with the unsharded run, state bytes per rank and the meta-device build are in
``test_trainer_equivalence.py``; FSDP checkpoints in ``test_checkpoint.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from cp_train.config.schema import ConfigError
from cp_train.config.sources import load_config
from cp_train.data.tokenizers.spm import train_tokenizer
from cp_train.memory.dry_run import dry_run_vocab
from cp_train.parallel.mesh.state import run_with_parallel
from tests import fsdp_cases, trainer_cases
from train import main as train_main

LAYOUT = (1, 2, 1)
GROUPS = trainer_cases.TINY_MODEL["num_layers"] + 1  # FSDP groups: every block and the root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.mark.parametrize("mode", ["fsdp", "fsdp-zero2", "ddp"])
def test_accumulation_reduces_once_per_step(spawn_world, corpus, tmp_path, mode) -> None:
    overrides = {"parallel.fsdp": mode != "ddp", "parallel.fsdp_reshard_after_forward": mode == "fsdp"}
    counts = spawn_world(2).run(run_with_parallel, LAYOUT, fsdp_cases.collectives_per_step, corpus, str(tmp_path),
                                overrides)[0]
    many, one = counts[trainer_cases.GLOBAL_BATCH], counts[1]  # micro-batches per rank -> collectives of a step
    if mode == "ddp":
        assert many.get("ddp_all_reduce", 0) == one.get("ddp_all_reduce", 0) > 0, counts
        assert "reduce_scatter_single" not in many, counts
        return
    assert many["reduce_scatter_single"] == one["reduce_scatter_single"] == GROUPS, counts
    if mode == "fsdp-zero2":  # the parameters stay gathered from one micro-batch to the next
        assert many["all_gather_single"] == one["all_gather_single"] == GROUPS, counts
    else:  # gathered for every forward and again for every backward, but the root's and the last block's
        assert many["all_gather_single"] > one["all_gather_single"] > GROUPS, counts


def test_reduce_scatters_overlap_the_backward_on_cpu(spawn_world, corpus, tmp_path) -> None:
    """gloo: FSDP2 would reduce-scatter synchronously; ours are asynchronous, all complete when the backward
    returns, a backward onto sharded gradients already there reduces in place, and the gradients are bitwise
    those of FSDP2's own synchronous reduce-scatter."""
    if "_fsdp_param_groups" not in vars(FSDPState()):  # torch 2.11: ``reduces_plainly`` is False, FSDP2's own runs
        pytest.skip("this torch's FSDP2 has one parameter group per module: its own reduce-scatter runs")
    for result in spawn_world(2).run(run_with_parallel, LAYOUT, fsdp_cases.reduce_scatters_overlap, corpus,
                                     str(tmp_path)):
        assert result["comm"] == "OverlappedReduceScatter", result
        assert result["step"] == {"async": GROUPS}, result
        assert result["in_flight"] == 0, result
        assert result["onto_grads"] == {"sync": GROUPS}, result
        assert result["exact"], result


def test_bf16_computes_in_bf16_with_fp32_master_weights(spawn_world, corpus, tmp_path) -> None:
    world = spawn_world(2)
    got = world.run(run_with_parallel, LAYOUT, fsdp_cases.bf16_step, corpus, str(tmp_path / "bf16"))[0]
    assert got["compute"] == torch.bfloat16
    assert got["stored"] == {torch.float32} and got["grads"] == {torch.float32}
    # every block gets the batch's own plan (its per-device index cache), not a copy made by input casting
    assert got["plan_type"] == "CPPlan" and got["blocks_run"] == got["expected_blocks"] >= 2, got
    assert got["foreign_plans"] == 0, got
    fp32 = world.run(run_with_parallel, LAYOUT, trainer_cases.train_layout, corpus, str(tmp_path / "fp32"),
                     {"parallel.fsdp": True}, 1)[0]["losses"][1]
    assert abs(got["loss"] - fp32) <= 2e-2 * fp32, (got["loss"], fp32)


def test_dry_run_of_the_8b_config_fits_on_80_gb(capsys) -> None:
    """``train.py --dry-run`` needs no process group: every rank's line, and the verdict for 8 x 80 GB."""
    assert train_main(["--config", "launch/configs/gpt-8b-128k-cp8.yaml", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("dry run of launch/configs/gpt-8b-128k-cp8.yaml: 8,030,261,248 parameters, world 8")
    ranks = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in ranks] == list(range(8))
    # fp32 parameters and AdamW's two moments: 4 and 8 B / parameter / 8, printed to three significant figures;
    # one micro-batch a step: at the peak only the gradients the backward has made (the last block's shard)
    for column, size in ((1, 4), (3, 8)):
        held = {float(row[column]) for row in ranks}
        assert len(held) == 1 and abs(held.pop() - size * 8_030_261_248 / 8 / 2**30) < 0.05, (column, ranks)
    assert {float(row[2]) for row in ranks} == {0.102}, ranks
    assert lines[-2].startswith("reserve: 7.00 GiB per device"), lines[-2]  # 3 GiB + 5% of 80
    assert lines[-1].startswith("fits: the largest rank (0) needs 26.9 GiB of 73.0 GiB usable"), lines[-1]
    # fused AdamW (the CUDA default) keeps the same state; its meta-device build must not refuse the dry run
    assert train_main(["--config", "launch/configs/gpt-8b-128k-cp8.yaml", "--dry-run", "--set",
                       "optimizer.implementation=fused"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


@pytest.mark.parametrize("config", sorted(p.name for p in Path("launch/configs").glob("gpt-*.yaml")))
def test_every_gpu_config_fits_80_gb_inside_the_reserve(capsys, config: str) -> None:
    """The shipped GPU configs name 8 x 80 GB: each fits with 3 GiB + 5% of the device kept back."""
    assert train_main(["--config", f"launch/configs/{config}", "--dry-run", "--device-memory-gib", "80"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("fits:")


def test_dry_run_that_does_not_fit_says_what_to_change_and_fails(capsys) -> None:
    """Exit status 1 when the largest rank exceeds the device, and a line naming the settings that shrink it."""
    argv = ["--config", "launch/configs/gpt-8b-128k-cp8.yaml", "--dry-run", "--device-memory-gib", "30"]
    assert train_main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("does NOT fit: the largest rank (0) needs 26.9 GiB of 25.5 GiB usable"), lines[-2]
    assert lines[-1].startswith("to fit: a larger parallel.tp"), lines[-1]
    assert train_main([*argv, "--set", "parallel.fsdp=false"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("to fit: --fsdp (shards parameters")


def test_dry_run_takes_the_vocabulary_training_would(tmp_path) -> None:
    """Configs that read their vocabulary from the tokenizer: the embedded corpus's, or a tokenizer file here."""
    config = load_config(Path("launch/configs/cpu-tiny.yaml"))
    assert config.model.vocab_size is None and dry_run_vocab(config) == 8192
    tokenizer = train_tokenizer([Path(textwrap.__file__)], 400, tmp_path / "tok")
    config.data.tokenizer = str(tokenizer)
    assert dry_run_vocab(config) == 512  # 400 ids, padded to a multiple of 128
    config.data.tokenizer = str(tmp_path / "elsewhere.model")
    with pytest.raises(ConfigError, match=r"needs model.vocab_size \(data.tokenizer \S+elsewhere.model is not on this "
                                          r"machine\): set it to the tokenizer's size"):
        dry_run_vocab(config)
