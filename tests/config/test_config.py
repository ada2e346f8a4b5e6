"""Config: YAML < flags < --set precedence, type coercion, unknown keys and old spellings, the shipped configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import train as train_script
from cp_train.config.flags import parse_config
from cp_train.config.schema import Config, ConfigError, dump_yaml
from cp_train.config.sources import build_config, load_config
from cp_train.config.validate import validate
from tests.config.config_cases import CONFIGS


@pytest.fixture()
def yaml_file(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  hidden_size: 96\n  num_heads: 4\noptimizer:\n  lr: 1e-3\n  min_lr: 1e-5\n"
                    "parallel:\n  cp: 2\ntrain:\n  steps: 50\n  valid_interval: 5\nlogging:\n  interval: 7\n")
    return path


def test_precedence_yaml_then_flags_then_set(yaml_file) -> None:
    only_yaml = parse_config(["--config", str(yaml_file)])
    assert (only_yaml.optimizer.lr, only_yaml.parallel.cp, only_yaml.train.steps) == (1e-3, 2, 50)
    assert only_yaml.model.hidden_size == 96 and only_yaml.logging.interval == 7
    assert only_yaml.train.micro_batch_size == Config().train.micro_batch_size  # untouched: the default
    flags = parse_config(["--config", str(yaml_file), "--lr", "2e-3", "--cp-size", "4", "--train-steps", "9"])
    assert (flags.optimizer.lr, flags.parallel.cp, flags.train.steps) == (2e-3, 4, 9)
    assert flags.model.hidden_size == 96  # YAML keys the flags do not name survive
    dotted = parse_config(["--config", str(yaml_file), "--lr", "2e-3", "--set", "optimizer.lr=3e-3",
                           "--cp-size", "4", "--set", "parallel.cp=8", "--set", "model.hidden_size=128"])
    assert (dotted.optimizer.lr, dotted.parallel.cp, dotted.model.hidden_size) == (3e-3, 8, 128)
    assert dotted.train.steps == 50


def test_megatron_aliases_and_script_keys() -> None:
    config = parse_config(["--tensor-model-parallel-size", "2", "--context-parallel-size", "4",
                           "--seq-length", "512", "--train-iters", "3", "--save", "ck", "--load", "ck2",
                           "--wandb-project", "p", "--wandb-mode", "disabled", "--micro-batch-size", "2",
                           "--global-batch-size", "16", "--set", "logging.dir=runs/x",
                           "--set", "checkpoint.interval=0", "--set", "train.valid_interval=0"])
    assert (config.parallel.tp, config.parallel.cp, config.data.seq_len, config.train.steps) == (2, 4, 512, 3)
    assert (config.checkpoint.save, config.checkpoint.load, config.checkpoint.interval) == ("ck", "ck2", 0)
    assert (config.logging.wandb_project, config.logging.wandb_mode, config.logging.dir) == ("p", "disabled",
                                                                                           "runs/x")
    assert (config.train.micro_batch_size, config.train.global_batch_size, config.train.valid_interval) == (2, 16, 0)


def test_values_are_coerced_to_the_field_types() -> None:
    config = load_config(None, overrides=["optimizer.lr=3e-4", "model.tie_embeddings=true", "train.steps=12",
                                          "parallel.dp=null", "data.prefix=/data/x", "model.vocab_size=512",
                                          "logging.peak_tflops=989"])
    assert config.optimizer.lr == 3e-4 and isinstance(config.optimizer.lr, float)
    assert config.model.tie_embeddings is True and config.train.steps == 12 and config.parallel.dp is None
    assert config.data.prefix == "/data/x" and config.model.vocab_size == 512
    assert config.logging.peak_tflops == 989.0
    derived = load_config(None, overrides=["model.hidden_size=384", "model.num_heads=6"])
    assert derived.model.num_kv_heads == 6 and derived.model.ffn_hidden_size == 1024  # derived after overrides
    assert dump_yaml(config).startswith("model:")


@pytest.mark.parametrize("override,message", [
    ("train.steps=ten", "train.steps expects int, got 'ten'"),
    ("train.steps=2.5", "train.steps expects int"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings expects bool"),
    ("optimizer.lr=fast", "optimizer.lr expects float"),
    ("train.steps=null", "train.steps must not be null"),
])
def test_bad_values_name_the_key(override, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides=[override])


@pytest.mark.parametrize("argv,message", [
    (["--set", "model.hiden_size=3"], "unknown config key 'model.hiden_size' .*did you mean 'model.hidden_size'"),
    (["--set", "trian.steps=3"], "unknown config key 'trian.steps'.*did you mean 'train'"),
    (["--set", "train.steps"], "must look like section.key=value"),
    (["--set", "train=3"], r"train is a config section, not a key: set one of its keys, train\.KEY=VALUE \(keys of "
                           r"train: steps, "),
    (["--set", "explicit_keys.x=1"], r"unknown config key 'explicit_keys.x': sections are model, parallel, data, "
                                     r"optimizer, schedule, train, checkpoint, logging, eval$"),
])
def test_unknown_or_malformed_overrides(argv, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


@pytest.mark.parametrize("text,message", [
    ("model:\n  hidden: 512\n", r"run.yaml: unknown config key 'model.hidden'"),
    ("modle:\n  hidden_size: 512\n", r"unknown config key 'modle.hidden_size'.*did you mean 'model'"),
    ("model: 3\n", "'model' must be a mapping"),
    ("- a\n- b\n", "the top level must be a mapping"),
    ("model: [\n", "not valid YAML"),
    ("model:\n  num_layers: 2\ntrain:\n  steps: 3\nmodel:\n  num_layers: 4\n",
     r"run.yaml:5:1: not valid YAML: 'model' appears twice in one mapping: merge the two"),
    ("model:\n  num_layers: 2\n  num_layers: 4\n", r"run.yaml:3:3: .*'num_layers' appears twice"),
])
def test_unknown_keys_in_yaml_name_the_key_and_the_file(tmp_path, text, message) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.parametrize("name,world", [("cpu-tiny.yaml", 2), ("gpt-125m-cp8.yaml", 8), ("gpt-1b-128k-cp8.yaml", 8),
                                        ("gpt-1b-128k-cp8.yaml", 16)])
def test_shipped_configs_are_valid(name, world) -> None:
    config = load_config(CONFIGS / name)
    assert config.parallel.cp == (2 if name == "cpu-tiny.yaml" else 8)
    assert config.data.document_mask and config.parallel.cp_layout == ("zigzag" if name == "cpu-tiny.yaml"
                                                                       else "balanced")
    assert config.parallel.backend == ("gloo" if name.startswith("cpu") else None)  # None: nccl on CUDA
    validate(config, world)
    assert config.logging.dir and config.logging.interval >= 1


@pytest.mark.parametrize("name", ["gpt-1b-128k-cp8.yaml", "gpt-8b-128k-cp8.yaml"])
def test_documented_multi_node_commands_are_valid(name) -> None:
    """The ``sbatch --nodes N ...`` line a GPU config documents validates at N nodes of 8 GPUs."""
    text = (CONFIGS / name).read_text()
    found = re.search(rf"sbatch --nodes (\d+) launch/slurm.sbatch launch/configs/{re.escape(name)}(.*)", text)
    assert found, f"{name} documents no multi-node command"
    flags = found.group(2).split("(")[0].split()
    config = parse_config(["--config", str(CONFIGS / name), *flags])
    assert validate(config, 8 * int(found.group(1))) == int(found.group(1))  # dp = nodes


def test_train_script_reports_config_errors(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_script.main(["--config", str(CONFIGS / "cpu-tiny.yaml"), "--set", "model.hidden=3"]) == 2
    assert "unknown config key 'model.hidden'" in capsys.readouterr().err
    assert train_script.main(["--config", str(CONFIGS / "cpu-tiny.yaml"), "--seq-len", "250"]) == 2
    assert "data.seq_len 250 is not divisible by 2*cp = 4" in capsys.readouterr().err
    assert train_script.main(["--config", str(CONFIGS / "cpu-tiny.yaml"), "--tensor-parallel", "2"]) == 2
    assert capsys.readouterr().err == ("train.py: error: unrecognized arguments: --tensor-parallel 2: did you mean "
                                       "--tensor-model-parallel-size 2 (--set parallel.tp=2)? (see python train.py "
                                       "--help)\n")
    assert train_script.main(["--config", str(CONFIGS / "cpu-tiny.yaml"), "--set", "optimizer.eps=nan"]) == 2
    assert capsys.readouterr().err == "train.py: error: optimizer.eps must be a finite number, got 'nan'\n"


def test_cp_layout_moved_to_parallel_with_a_deprecation_note() -> None:
    config = build_config([("old.yaml", {"model.attention_layout": "stripe"})])
    assert config.parallel.cp_layout == "stripe"
    assert config.deprecations == ("old.yaml: model.attention_layout is deprecated, use parallel.cp_layout "
                                   "(read as that)",)
    flags = parse_config(["--cp-layout", "balanced", "--cp-algorithm", "a2a+p2p", "--ulysses-size", "2"])
    assert (flags.parallel.cp_layout, flags.parallel.cp_algorithm, flags.parallel.ulysses_size) == \
        ("balanced", "a2a+p2p", 2)
    assert parse_config(["--cp-comm-type", "all_gather"]).parallel.cp_algorithm == "all_gather"


def test_the_installed_package_runs_the_same_command(tmp_path) -> None:
    """``python -m cp_train`` (``torchrun -m cp_train`` where the package is installed) is train.py, from any
    directory."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "cp_train", "--config", str(CONFIGS / "cpu-tiny.yaml"), "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("dry run of "), done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "cp_train", "--config", str(tmp_path / "missing.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("cp_train: error: --config "), done.stderr
