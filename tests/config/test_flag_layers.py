"""The command line's layers and other frameworks' names (``cp_train/config/flags.py``, ``foreign_flags.py``):

- the global batch and gradient accumulation: set together they must agree; set in different layers the higher
  one decides;
- with no ``--config``, training and ``--dry-run`` use the same default config, and ``--init-from-hf`` takes the
  model's shape over it (a config the user names still conflicts);
- torchtitan's ``--parallelism.*``/``--training.*``/... names are read as ours with a one-line note; Megatron-LM's
  ``--rotary-base`` and ``--split`` are ours, its ``--use-distributed-optimizer`` and FP8 flags are refused with a
  hint naming ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cp_train.cli.train import DEFAULT_CPU_CONFIG
from cp_train.cli.train import main as train_main
from cp_train.config.flags import _flag_of, parse_args, parse_config
from cp_train.config.foreign_flags import SHARD_DEGREE, TORCHTITAN_KEYS, torchtitan_spellings
from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate, with_accumulation

CPU_TINY = str(DEFAULT_CPU_CONFIG)  # micro_batch_size 4, global_batch_size 8, cp 2
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 64,
             "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0,
             "tie_word_embeddings": False}


def _batch(argv: list[str], world: int = 4) -> tuple[int, int | None]:
    """(global batch, accumulation steps) of ``argv`` on ``world`` ranks after the checks training runs."""
    config = with_accumulation(parse_config(argv), world)
    validate(config, world)
    return config.train.global_batch_size, config.train.gradient_accumulation_steps


def test_global_batch_and_accumulation(tmp_path: Path) -> None:
    tiny = ["--config", CPU_TINY]  # at 4 ranks: cp 2, dp 2, micro-batch 4
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps 2 makes the global batch "
                                          r"micro_batch_size\*dp\*steps = 4\*2\*2, not train\.global_batch_size 8"):
        _batch([*tiny, "--global-batch-size", "8", "--gradient-accumulation-steps", "2"])
    assert _batch([*tiny, "--global-batch-size", "16", "--gradient-accumulation-steps", "2"]) == (16, 2)
    assert _batch([*tiny, "--gradient-accumulation-steps", "3"]) == (24, 3)  # over the file's global batch
    assert _batch([*tiny, "--set", "train.gradient_accumulation_steps=2"]) == (16, 2)
    both = tmp_path / "both.yaml"
    both.write_text(Path(CPU_TINY).read_text().replace("global_batch_size: 8", "global_batch_size: 8\n  "
                                                       "gradient_accumulation_steps: 1"))
    assert _batch(["--config", str(both)]) == (8, 1)
    assert _batch(["--config", str(both), "--global-batch-size", "32"]) == (32, None)  # over the file's steps
    with pytest.raises(ConfigError, match="not train.global_batch_size 8"):
        _batch(["--config", str(both), "--set", "train.micro_batch_size=2"])  # the file's two disagree now


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default config is the CPU demo's on a machine without CUDA")
def test_dry_run_without_config_plans_the_default_training_config(capsys) -> None:
    assert train_main(["--dry-run"]) == 0
    default = capsys.readouterr().out.splitlines()
    assert default[0] == f"[cp-train] no --config: using {CPU_TINY} (this machine has no CUDA GPU)"
    assert train_main(["--config", CPU_TINY, "--dry-run"]) == 0
    assert default[1:] == capsys.readouterr().out.splitlines()


def test_init_from_hf_shapes_win_over_the_default_config(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    config, _ = parse_args(["--init-from-hf", str(tmp_path)], default_config=CPU_TINY)
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_heads, model.ffn_hidden_size, model.tie_embeddings,
            model.max_position_embeddings) == (2, 64, 4, 160, False, 2048)
    assert (config.parallel.cp, config.data.seq_len) == (2, 256)  # the rest of the default config stays
    kept, _ = parse_args(["--init-from-hf", str(tmp_path), "--max-position-embeddings", "4096"],
                         default_config=CPU_TINY)
    assert kept.model.max_position_embeddings == 4096  # the user's RoPE field still wins
    with pytest.raises(ConfigError, match=r"these keys were set to other values: model\.num_layers=4"):
        parse_args(["--config", CPU_TINY, "--init-from-hf", str(tmp_path)])  # a file the user names: theirs
    if not torch.cuda.is_available():
        assert train_main(["--init-from-hf", str(tmp_path), "--dry-run"]) == 0
        assert "217,408 parameters" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(TORCHTITAN_KEYS))
def test_torchtitan_names_read_as_ours_with_a_note(name: str) -> None:
    key = TORCHTITAN_KEYS[name]
    value = {"model.activation_checkpointing": "full", "data.seq_len": "512"}.get(key, "3")
    ours = parse_config(["--set", f"{key}={value}"])
    for spelling in torchtitan_spellings(name):
        config, _ = parse_args([spelling, value])
        expected = ours.to_dict()
        if name == SHARD_DEGREE:
            expected["parallel"]["fsdp"] = True
        assert config.to_dict() == expected, spelling
        flag = _flag_of(key)
        shown = "--dp-size 3 --fsdp" if name == SHARD_DEGREE else f"{flag} {value}" if flag else f"--set {key}={value}"
        assert config.deprecations == (f"command line: --{name} is torchtitan's name: read as {shown} ({key})",)


def test_torchtitan_edge_cases() -> None:
    rest, _ = parse_args(["--parallelism.data_parallel_shard_degree", "-1", "--cp-size", "2"])
    assert (rest.parallel.dp, rest.parallel.fsdp) == (None, True)
    one, _ = parse_args(["--parallelism.data_parallel_shard_degree", "1"])
    assert (one.parallel.dp, one.parallel.fsdp) == (1, False)
    with pytest.raises(ConfigError, match=r"^--parallelism\.context_parallel_degree \(torchtitan's name\) and "
                                          r"--cp-size both set parallel\.cp: keep one$"):
        parse_args(["--cp-size", "2", "--parallelism.context_parallel_degree", "4"])


@pytest.mark.parametrize(("argv", "hint"), [
    (["--use-distributed-optimizer"], "use --fsdp (parallel.fsdp=true: FSDP2 shards the optimizer state"),
    (["--use_distributed_optimizer"], "use --fsdp (parallel.fsdp=true: FSDP2 shards the optimizer state"),
    (["--fp8-format", "hybrid"], "use --set model.fp8=tensorwise (torchao's float8 training"),
    (["--fp8-recipe", "rowwise"], "use --set model.fp8=rowwise (torchao's dynamic scaling"),
    (["--fp8-recipe", "delayed"], "use --set model.fp8=tensorwise (torchao's dynamic scaling"),
    (["--first-last-layers-bf16"], "use --set model.fp8_bf16_layers_at_start=1 --set model.fp8_bf16_layers_at_end=1"),
    (["--num-layers-at-end-in-bf16", "2"], "use --set model.fp8_bf16_layers_at_end=2"),
])
def test_megatron_flags_without_an_alias_get_a_hint(argv: list[str], hint: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(argv)
    message = str(error.value)
    assert "\n" not in message and f"Megatron-LM's {argv[0].split('=')[0]} has no alias here: {hint}" in message


def test_megatron_rotary_base_and_split_are_ours() -> None:
    """``--rotary-base`` is RoPE's base; ``--split 969,30,1`` holds out the valid and test documents (the last 3.1%),
    so that the training documents are Megatron-LM's."""
    config = parse_config(["--rotary-base", "500000", "--split", "969,30,1"])
    assert config.model.rope_theta == 500000.0 and config.data.valid_fraction == pytest.approx(0.031)
    assert parse_config(["--split", "98/2"]).data.valid_fraction == pytest.approx(0.02)
    assert parse_config(["--split", "100"]).data.valid_fraction == 0.0
    for bad in ("0,1,1", "90,5,5,1", "a,b", "90,-5,5"):
        with pytest.raises(ConfigError, match=r"^argument --split: takes the train,valid,test weights of the "
                                              r"documents, such as 969,30,1, got '"):
            parse_config(["--split", bad])
