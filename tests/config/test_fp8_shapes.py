"""``model.fp8``'s shape rules on the config (``cp_train/config/fp8_shapes.py``): the GPU's FP8 GEMMs need weight
dims, a micro-batch's tokens per rank and each MLP chunk's tokens in multiples of 16, refused by ``validate`` (and so
by the dry run) with one line; and the notes an FP8 run logs. Pure config arithmetic: no torchao needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cp_train.config.fp8_shapes import fp8_notes
from cp_train.config.schema import Config, ConfigError
from cp_train.config.sources import build_config
from cp_train.config.validate import validate
from cp_train.errors import describe

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"model.vocab_size": 128, "data.eod_id": 0, "model.num_layers": 2, "model.hidden_size": 64,
         "model.num_heads": 4, "model.num_kv_heads": 2, "model.ffn_hidden_size": 128, "data.seq_len": 64,
         "model.max_position_embeddings": 4096, "train.micro_batch_size": 1, "train.global_batch_size": 8}


def _config(**values: Any) -> Config:
    return build_config([("test", {**SMALL, "model.fp8": "tensorwise", **{k.replace("__", "."): v
                                                                            for k, v in values.items()}})])


def _error(config: Config) -> str:
    world = config.parallel.tp * config.parallel.cp * (config.parallel.dp or 1)
    with pytest.raises(ConfigError) as caught:
        validate(config, world)
    line, code, _ = describe(caught.value)
    assert code == 2 and "\n" not in line
    config.model.fp8 = "none"  # the same config without FP8 is fine
    validate(config, world)
    return line


def test_tokens_per_rank_that_are_no_multiple_of_16_are_refused() -> None:
    assert _error(_config(data__seq_len=40)) == (
        "model.fp8 tensorwise: the weights' gradients are GEMMs over a micro-batch's tokens per rank, "
        "train.micro_batch_size * data.seq_len / parallel.cp = 1 * 40 / 1 = 40, and the GPU's FP8 GEMMs need a "
        "multiple of 16: make data.seq_len a multiple of 16 or train.micro_batch_size a multiple of 2, or set "
        "model.fp8=none")
    cp2 = _error(_config(data__seq_len=48, parallel__cp=2, model__fp8="rowwise"))  # 24 tokens per CP rank
    assert cp2.startswith("model.fp8 rowwise: ") and "= 1 * 48 / 2 = 24," in cp2
    assert "make data.seq_len a multiple of 32 or train.micro_batch_size a multiple of 2" in cp2
    for fine in (_config(data__seq_len=40, train__micro_batch_size=2),  # 80 tokens
                 _config(data__seq_len=48, parallel__tp=2)):  # sequence parallel: the linears see all 48 again
        validate(fine, fine.parallel.tp)


def test_mlp_chunks_that_cut_uneven_token_counts_are_refused() -> None:
    line = _error(_config(data__seq_len=2048, model__mlp_chunks=3))
    assert line == ("model.fp8 tensorwise: model.mlp_chunks 3 cuts a micro-batch's 1 x 2048 tokens per rank "
                    "(train.micro_batch_size x data.seq_len / parallel.cp) into MLP chunks of 683 and 682 tokens, "
                    "and the GPU's FP8 GEMMs need multiples of 16: set model.mlp_chunks to 2 or 4, or "
                    "model.fp8=none")
    assert "set model.mlp_chunks to 3 or 6," in _error(_config(data__seq_len=96, model__mlp_chunks=4))  # 24 each
    for fine in (_config(data__seq_len=2048, model__mlp_chunks=4), _config(data__seq_len=96, model__mlp_chunks=3),
                 _config(data__seq_len=1024, model__mlp_chunks=3, train__micro_batch_size=16,
                         train__global_batch_size=16)):  # 16 x 342 and 16 x 341 tokens
        validate(fine, 1)


def test_weight_dims_that_are_no_multiple_of_16_on_a_tp_rank_are_refused() -> None:
    odd = {"model__hidden_size": 40, "model__num_heads": 4, "model__num_kv_heads": 2, "model__ffn_hidden_size": 64}
    assert _error(_config(**odd)) == (
        "model.fp8 tensorwise: the GPU's FP8 GEMMs need weight dims that are multiples of 16 and the blocks' qkv "
        "weight is [80, 40] on each TP rank (parallel.tp 1): change the model's widths (model.hidden_size, "
        "ffn_hidden_size, num_heads, num_kv_heads, head_dim) or parallel.tp, or set model.fp8=none")
    # 8 heads of 8, 8 kv heads: at tp 4 qkv [48, 64], out [64, 16], gate+up [64, 64], down [64, 32]; at tp 8 qkv
    # is [24, 64]
    validate(_config(model__num_heads=8, model__num_kv_heads=8, parallel__tp=4), 4)
    line = _error(_config(model__num_heads=8, model__num_kv_heads=8, parallel__tp=8))
    assert "the blocks' qkv weight is [24, 64] on each TP rank (parallel.tp 8): change" in line


def test_the_dry_run_refuses_it_with_one_line_and_exit_2(tmp_path) -> None:
    config = ROOT / "launch" / "configs" / "cpu-tiny.yaml"
    done = subprocess.run([sys.executable, "-m", "cp_train", "--config", str(config), "--dry-run", "--set",
                           "model.fp8=tensorwise", "--set", "model.mlp_chunks=3"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "cp_train: error: model.fp8 tensorwise: model.mlp_chunks 3 cuts a micro-batch's 4 x 128 tokens"), done.stderr


def test_the_notes_of_an_fp8_run() -> None:
    """Eager FP8 on a GPU is a warning (not compiled, not on the CPU, not without FP8); under FSDP tensorwise names
    the block linears it gathers in the compute dtype: those whose sharded dim does not split evenly."""
    eager = _config()
    assert fp8_notes(eager, 1, cuda=True) == (
        "warning: model.fp8 tensorwise without train.compile runs many small cast and scale kernels around each "
        "matmul, usually slower than bf16: set train.compile=true (--compile)",)
    assert fp8_notes(_config(train__compile=True), 1, cuda=True) == () and fp8_notes(eager, 1, cuda=False) == ()
    assert fp8_notes(_config(model__fp8="none"), 1, cuda=True) == ()
    # hidden 48, head_dim 12: qkv [96, 48], out [48, 48], gate+up [256, 48], down [48, 128]
    fsdp = _config(model__hidden_size=48, parallel__fsdp=True, train__global_batch_size=6)
    assert fp8_notes(fsdp, 3, cuda=False) == (
        "model.fp8 tensorwise: FSDP gathers the blocks' mlp gate+up weights in the compute dtype, not FP8, as they "
        "do not split evenly over its 3 ranks (their matmuls still run in FP8)",)
    assert fp8_notes(fsdp, 2, cuda=False) == ()  # every dim 0 splits in two
    hsdp = _config(model__hidden_size=48, parallel__fsdp=True, parallel__dp_replicate=2, train__global_batch_size=6)
    assert fp8_notes(hsdp, 6, cuda=False)[0].endswith("over its 3 ranks (their matmuls still run in FP8)")
    tp2 = _config(model__hidden_size=48, parallel__fsdp=True, parallel__tp=2, train__global_batch_size=6)
    # tp 2: FSDP splits the column-parallel weights along dim 1 (hidden, 48): qkv [48, 48], gate+up [64, 48]
    assert fp8_notes(tp2, 3, cuda=False) == ()
    assert fp8_notes(_config(model__hidden_size=48, parallel__fsdp=True, model__fp8="rowwise"), 3, cuda=False) == ()
