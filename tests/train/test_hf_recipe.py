"""The README's CPU demo of the long-context recipe, end to end (shortened to 2 steps): a tiny random HF Llama
(context 128) from cp_train.cli.tiny_hf, its tokenizer.json in cp-train-preprocess, 4 torchrun ranks at cp=4 with
llama3 scaling to 512, export, and transformers loading the result as the same function at 512 tokens."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from cp_train.cli.export_hf import run as export_main
from cp_train.cli.preprocess import main as preprocess_main
from cp_train.cli.tiny_hf import run as tiny_hf_main
from cp_train.errors import InputError
from cp_train.model.hf.llama import load_llama
from cp_train.parallel.spawn import free_port
from tests.numerics import rel_err

ROOT = Path(__file__).resolve().parents[2]


def test_readme_cpu_recipe(tmp_path) -> None:
    tiny = tiny_hf_main([str(tmp_path / "tiny-llama")])
    with pytest.raises(InputError, match=r"tiny-llama already holds a model \(config.json\): pass a new directory"):
        tiny_hf_main([str(tiny)])  # never overwrites a model
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert preprocess_main(["--input", str(stdlib / "json"), "--tokenizer", str(tiny), "--output-prefix",
                            f"{tmp_path}/"]) == 2  # a directory, not a prefix
    preprocess_main(["--input", str(stdlib / "email"), str(stdlib / "json"), "--glob", "*.py", "--tokenizer",
                     str(tiny), "--output-prefix", str(tmp_path / "data"), "--quiet"])
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
               str(free_port()), "train.py", "--config", "launch/configs/cpu-hf-extend.yaml", "--init-from-hf",
               str(tiny), "--tokenizer-model", str(tiny), "--data-path", str(tmp_path / "data"), "--train-steps", "2",
               "--lr-warmup-iters", "1", "--eval-interval", "0", "--set", f"logging.dir={run_dir}", "--set",
               "logging.wandb=false",
               "--set", f"checkpoint.save={run_dir}/checkpoints", "--set", "checkpoint.interval=0"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"train.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "world 4 = tp 1 x cp 4 x dp 1" in done.stdout and "step 2/2" in done.stdout
    assert f"initialised from the Hugging Face model {tiny}" in done.stdout

    out = export_main([str(run_dir / "checkpoints"), str(tmp_path / "tiny-llama-512")])
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 512 and config["eos_token_id"] == 1
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    assert (out / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, config["vocab_size"], (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits
        got = load_llama(out)(tokens)
    assert rel_err(got, expected) < 1e-5


def test_the_gpu_recipe_fits_8_x_80_gb_with_llama_2_7b(tmp_path, monkeypatch, capsys) -> None:
    """docs/huggingface.md's recipe command, dry-run on a Llama-2-7B config.json (8 ranks, cp 4): it fits inside
    the reserve with its --fsdp, and without it does not."""
    from cp_train.cli.train import main as train_main

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}))
    recipe = (ROOT / "docs" / "huggingface.md").read_text()
    command = recipe[recipe.index("cp-train-launch --nproc-per-node 8 train.py"):]
    command = command[:command.index("\ncp-train-export-hf")].replace("\\\n", " ")
    assert " --fsdp " in command
    args = shlex.split(command.split("train.py", 1)[1].replace("DIR", str(tmp_path)))
    at = args.index("--tokenizer-model")  # no tokenizer files here: the vocabulary is config.json's, EOD given
    argv = [*args[:at], *args[at + 2:], "--set", "data.eod_id=2"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert train_main([*argv, "--dry-run", "--device-memory-gib", "80"]) == 0, capsys.readouterr().out
    assert train_main([a for a in argv if a != "--fsdp"] + ["--dry-run", "--device-memory-gib", "80"]) == 1
