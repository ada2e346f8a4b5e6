"""RoPE scaling with Hugging Face's field names and semantics: frequencies and attention factors equal
transformers' own ``ROPE_INIT_FUNCTIONS``, defaults are filled in as HF fills them, bad fields are named."""

from __future__ import annotations

import pytest
import torch

from cp_train.config.schema import ConfigError
from cp_train.config.sources import load_config
from cp_train.config.validate import validate
from cp_train.model.config import ModelConfig
from cp_train.model.hf.rope_scaling import ROPE_TYPES, resolve_rope_scaling
from cp_train.model.rope import rope_frequencies, rope_tables
from tests.numerics import rel_err

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {  # name -> (rope_scaling, max_position_embeddings)
    "linear": ({"rope_type": "linear", "factor": 4.0}, 256),
    "llama3": (LLAMA3, 512),
    "llama3 other factors": ({**LLAMA3, "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}, 2048),
    "llama3 implicit original": ({k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}, 64),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    "yarn old 'type' key": ({"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}, 256),
    "yarn mscale": ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}, 1024),
    "yarn attention_factor": ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25,
                               "original_max_position_embeddings": 64}, 128),
    "yarn factor from the contexts": ({"rope_type": "yarn", "factor": None,
                                       "original_max_position_embeddings": 64}, 512),
}


def _hf_frequencies(scaling: dict, head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=max_positions,
                         rope_theta=theta, rope_scaling=dict(scaling))
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_equal_transformers(name: str) -> None:
    scaling, max_positions = CASES[name]
    for theta, head_dim in ((10000.0, 16), (500000.0, 64), (1e6, 128)):
        expected, expected_factor = _hf_frequencies(scaling, head_dim, theta, max_positions)
        got, factor = rope_frequencies(head_dim, theta, scaling, max_positions)
        assert rel_err(got, expected) < 1e-6, (name, theta, head_dim)  # transformers works in fp32
        assert abs(factor - expected_factor) < 1e-12, (name, factor, expected_factor)
        unscaled, _ = rope_frequencies(head_dim, theta)
        assert rel_err(got, unscaled) > 1e-3, "the scaling must change the frequencies"


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    scaling = CASES["yarn mscale"][0]
    positions = torch.arange(8).view(1, 8)
    cos, sin = rope_tables(positions, 16, 10000.0, torch.float64, scaling, 1024)
    _, factor = rope_frequencies(16, 10000.0, scaling, 1024)
    assert factor != 1.0
    assert torch.allclose(cos.square() + sin.square(), torch.full_like(cos, factor**2), atol=1e-12)


def test_defaults_are_filled_as_transformers_fills_them() -> None:
    yarn = resolve_rope_scaling({"rope_type": "yarn", "factor": 4.0}, 128)
    assert yarn["original_max_position_embeddings"] == 128 and yarn["beta_fast"] == 32 and yarn["beta_slow"] == 1
    assert yarn["truncate"] is True and abs(yarn["attention_factor"] - (0.1 * torch.tensor(4.0).log() + 1)) < 1e-7
    assert resolve_rope_scaling({"rope_type": "default"}, 128) is None
    assert resolve_rope_scaling(None, 128) is None


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type 'dynamic' cannot be trained: its theta "
                                              "depends on the current sequence length"),
    ({"rope_type": "longrope", "factor": 2.0}, "unknown rope_scaling.rope_type 'longrope'; known types: "
                                               + ", ".join(ROPE_TYPES)),
    ({"factor": 2.0}, "unknown rope_scaling.rope_type None"),
    ({"rope_type:yarn": None, "factor:4.0": None}, "reads as keys without values: in YAML put a space after each"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope_type 'llama3' is missing high_freq_factor"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "rope_type 'linear' does not take beta_fast"),
    ({"rope_type": "linear", "factor": 0.5}, "rope_scaling.factor must be a number >= 1.0, got 0.5"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "rope_scaling.high_freq_factor (1.0) must be larger than low_freq_factor"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "32"},
     "original_max_position_embeddings must be an integer >= 1, got '32'"),
    ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, "rope_type 'linear' and type 'yarn'"),
    ("llama3", "rope_scaling must be a mapping"),
])
def test_bad_scaling_is_named(scaling, message: str) -> None:
    with pytest.raises(ValueError) as error:
        ModelConfig(num_layers=1, hidden_size=64, num_heads=4, rope_scaling=scaling).validate()
    assert message in str(error.value)


def test_rope_scaling_from_yaml_flags_and_set(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  rope_scaling:\n    rope_type: linear\n    factor: 2.0\n  rope_theta: 500000\n")
    assert load_config(path).model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    config = load_config(path, overrides=["model.rope_scaling={rope_type: yarn, factor: 4.0}"])
    assert config.model.rope_scaling == {"rope_type": "yarn", "factor": 4.0} and config.model.rope_theta == 5e5
    assert load_config(overrides=["model.rope_scaling=null"]).model.rope_scaling is None
    with pytest.raises(ConfigError, match=r"model.rope_scaling expects a mapping such as \{rope_type: llama3"):
        load_config(overrides=["model.rope_scaling=llama3"])
    config = load_config(overrides=["model.rope_scaling={rope_type: longrope, factor: 4.0}", "model.vocab_size=128"])
    with pytest.raises(ConfigError, match="model: unknown rope_scaling.rope_type 'longrope'; known types: default"):
        validate(config, 1)
