"""Hugging Face directories the model cannot load: each is one clear error naming the file or the field.
Also: both config styles (transformers 4: ``rope_theta`` + ``rope_scaling``; 5: ``rope_parameters``) load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cp_train.model.config import ModelConfig
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.config import HFConfigError, model_fields, read_hf_config
from cp_train.model.hf.llama import load_llama, save_llama

SHAPE = {"vocab_size": 64, "num_layers": 1, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 48, "max_position_embeddings": 64, "norm_eps": 1e-6}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good")
    save_llama(GPTModel(ModelConfig(**SHAPE)), path)
    return path


def _copy(good: Path, target: Path, **config_changes) -> Path:
    shutil.copytree(good, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "architectures ['GPT2LMHeadModel'] (model_type 'gpt2') is not a supported causal LM: only LlamaForCausalLM, "
     "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GraniteSWAForCausalLM"),
    ({"architectures": ["LlamaModel"]}, "is not a supported causal LM"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "llama"}, "is not a supported causal LM"),
    ({"mlp_bias": True}, "mlp_bias = true is not supported: the MLP has no biases"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_bias": True},
     "attention_bias = true is not supported: MistralForCausalLM ignores it"),
    ({"head_dim": 15}, "head_dim = 15 is not supported: head_dim must be an even integer"),
    ({"hidden_act": "gelu"}, "hidden_act = \"gelu\" is not supported: the MLP is SwiGLU (silu)"),
    ({"use_qk_norm": True}, "use_qk_norm = true is not supported: LlamaForCausalLM has no such query/key norms"),
    ({"sliding_window": 4096}, "sliding_window = 4096 is not supported: LlamaForCausalLM has full causal attention"),
    ({"layer_types": ["sliding_attention"]}, "layer_types = [\"sliding_attention\"] is not supported"),
    ({"architectures": ["GraniteSWAForCausalLM"], "model_type": "granite_swa", "attention_multiplier": 1.0},
     "attention_multiplier = 1.0 is not supported: the model's softmax scale is head_dim ** -0.5"),
    ({"architectures": ["GraniteSWAForCausalLM"], "model_type": "granite_swa", "residual_multiplier": 0.2},
     "residual_multiplier = 0.2 is not supported: the model computes granite_swa with neutral multipliers"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5 is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1 is not supported: the model has no dropout"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config = {\"quant_method\": \"gptq\"} is not"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling: rope_scaling.rope_type 'dynamic' cannot be trained: its theta depends on the current sequence "
     "length"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_parameters: unknown rope_scaling.rope_type 'longrope'"),
    ({"rope_theta": -1}, "rope_theta must be a number > 1, got -1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
])
def test_unsupported_config_fields_are_named(good, tmp_path, changes, message: str) -> None:
    path = _copy(good, tmp_path / "m", **changes)
    with pytest.raises(HFConfigError) as error:
        load_llama(path)
    assert message in str(error.value) and str(path / "config.json") in str(error.value)


def test_missing_files_are_named(good, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_llama(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty has no config.json: a Hugging Face model directory holds"):
        load_llama(tmp_path / "empty")
    no_weights = _copy(good, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json "
                                                r"\(found pytorch_model.bin: convert them to safetensors\)"):
        load_llama(no_weights)
    sharded = tmp_path / "sharded"
    save_llama(GPTModel(ModelConfig(**SHAPE)), sharded, max_shard_bytes=10_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[1].name.startswith("model-00002-of-")
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"{shards[1].name}, listed in .*"
                                                "model.safetensors.index.json, is missing"):
        load_llama(sharded)
    broken = _copy(good, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match="config.json is not valid JSON"):
        load_llama(broken)


def test_weights_that_do_not_fit_the_config_are_named(good, tmp_path) -> None:
    missing = _copy(good, tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor lm_head.weight is missing from the weights in .* \\(config.json "
                                         "says tie_word_embeddings = false\\)"):
        load_llama(missing)
    wrong = _copy(good, tmp_path / "wrong", intermediate_size=64)
    with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.gate_proj.weight in .*model.safetensors has "
                                         r"shape \[48, 32\]; the config implies \[64, 32\]"):
        load_llama(wrong)


def test_both_config_styles_give_the_same_model_fields(good, tmp_path) -> None:
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    v4 = read_hf_config(_copy(good, tmp_path / "v4", rope_theta=5e5, rope_scaling={**scaling}))
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**scaling, "rope_theta": 5e5}
    assert model_fields(v4) == model_fields(v5)
    fields = model_fields(v5)
    assert fields["rope_theta"] == 5e5 and fields["rope_scaling"] == scaling and fields["norm_eps"] == 1e-6
    implicit = {**v5, "rope_parameters": {"type": "yarn", "factor": 2.0}}
    assert model_fields(implicit)["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0,
                                                      "original_max_position_embeddings": 64}
    defaults = {k: v for k, v in v5.items() if k not in ("rope_parameters", "rms_norm_eps", "num_key_value_heads")}
    fields = model_fields(defaults)  # HF's defaults: eps 1e-6, theta 1e4, no GQA
    assert (fields["norm_eps"], fields["rope_theta"], fields["num_kv_heads"]) == (1e-6, 1e4, 4)
    assert torch.equal(load_llama(good).norm.weight, torch.ones(32))
