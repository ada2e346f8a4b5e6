"""Model shapes the planner knows by name, and ``load_model`` for a name, an HF config.json or a project YAML.

Each preset is the ``ModelConfig`` of the model's Hugging Face ``config.json`` (vocab, hidden, intermediate,
layers, heads, kv heads, RoPE theta and scaling, max positions, RMSNorm eps, tied embeddings); the planner
needs only the shapes. ``gpt-1b`` / ``gpt-8b`` are the model sections of this repo's launch configs.
``parameter_count`` counts the weights as the model's family builds them (``model/family.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cp_train.config.schema import ConfigError
from cp_train.config.sources import load_config
from cp_train.errors import InputError
from cp_train.model.config import ModelConfig
from cp_train.model.family import get_model_family
from cp_train.model.hf.config import HFConfigError, model_fields, read_hf_config

ROOT = Path(__file__).resolve().parents[3]
# Llama 3.1's RoPE scaling, as in its config.json
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama3-8b": dict(vocab_size=128256, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling=LLAMA31_ROPE, norm_eps=1e-5, tie_embeddings=False),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama3-70b": dict(vocab_size=128256, num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                       ffn_hidden_size=28672, max_position_embeddings=131072, rope_theta=500000.0,
                       rope_scaling=LLAMA31_ROPE, norm_eps=1e-5, tie_embeddings=False),
    # https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    "llama3-405b": dict(vocab_size=128256, num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
                        ffn_hidden_size=53248, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=LLAMA31_ROPE, norm_eps=1e-5, tie_embeddings=False),
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json (no GQA)
    "llama2-7b": dict(vocab_size=32000, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                      ffn_hidden_size=11008, max_position_embeddings=4096, rope_theta=10000.0,
                      norm_eps=1e-5, tie_embeddings=False),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json. Qwen2.5 has q/k/v projection biases
    # (4,608 per layer, 129,024 in all), which the model does not have yet; the shapes are exact and the
    # parameter count is 0.002% short (7,615,487,488 here against 7,615,616,512).
    "qwen2.5-7b": dict(vocab_size=152064, num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
                       ffn_hidden_size=18944, max_position_embeddings=131072, rope_theta=1000000.0,
                       norm_eps=1e-6, tie_embeddings=False),
}
# presets read from this repo's launch configs (a source checkout); vocab_size when the config leaves it to the
# tokenizer: 32768, the vocabulary bench/gpu.py gives the 1B shape (docs/benchmarks.md, "On one H100")
CONFIG_PRESETS: dict[str, tuple[str, int | None]] = {
    "gpt-1b": ("launch/configs/gpt-1b-128k-cp8.yaml", 32768),
    "gpt-8b": ("launch/configs/gpt-8b-128k-cp8.yaml", None),
}
class ModelSpecError(InputError):
    """A model spec that names no preset and no readable config; the message lists the presets."""


def preset_names() -> list[str]:
    """Every preset name, sorted."""
    return sorted([*PRESETS, *CONFIG_PRESETS])


def _yaml_model(path: Path, source: str, vocab_size: int | None) -> ModelConfig:
    try:
        model = load_config(path, what="model config").model
    except ConfigError as error:
        raise ModelSpecError(str(error)) from None
    if model.vocab_size is None:
        if vocab_size is None:
            raise ModelSpecError(f"{source}: model.vocab_size is null (the tokenizer sets it when training): "
                                 f"set model.vocab_size in the file or pass the tokenizer's vocabulary size")
        model.vocab_size = vocab_size
    return model


def model_preset(name: str) -> ModelConfig:
    """A new ``ModelConfig`` of preset ``name``; ``ModelSpecError`` listing the presets for an unknown name."""
    if name in PRESETS:
        return ModelConfig(**{key: (dict(value) if isinstance(value, dict) else value)
                              for key, value in PRESETS[name].items()})
    if name in CONFIG_PRESETS:
        relative, vocab = CONFIG_PRESETS[name]
        path = ROOT / relative
        if not path.is_file():
            raise ModelSpecError(f"preset {name} reads {relative}, which is not here (a source checkout has it)")
        return _yaml_model(path, f"preset {name} ({relative})", vocab)
    raise ModelSpecError(f"unknown model preset {name!r}; choose one of {', '.join(preset_names())}")


def load_model(spec: str | Path, vocab_size: int | None = None) -> ModelConfig:
    """The model of ``spec``: a preset name, a Hugging Face ``config.json`` (or its directory), or a project
    YAML config (its ``model`` section; ``vocab_size`` fills a null ``model.vocab_size``, which training takes
    from the tokenizer). One-line ``ModelSpecError`` saying what to pass otherwise."""
    text = str(spec)
    if text in PRESETS or text in CONFIG_PRESETS:
        return model_preset(text)
    path = Path(text)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ModelSpecError(f"model config {text} does not exist: pass a project YAML config, "
                                 f"a Hugging Face config.json or a preset ({', '.join(preset_names())})")
        return _yaml_model(path, str(path), vocab_size)
    if path.suffix == ".json" and not path.is_file():
        raise ModelSpecError(f"Hugging Face config {text} does not exist: pass an existing config.json (or its "
                             f"directory), a project YAML config or a preset ({', '.join(preset_names())})")
    if path.suffix == ".json" or path.is_dir():
        try:
            return ModelConfig(**model_fields(read_hf_config(path)))
        except (HFConfigError, FileNotFoundError) as error:
            raise ModelSpecError(str(error)) from None
    raise ModelSpecError(f"unknown model {text!r}: choose a preset ({', '.join(preset_names())}), "
                         f"or pass a project YAML config or a Hugging Face config.json")


def layer_parameters(model: ModelConfig) -> int:
    """Weights of one block (its family's, ``model/family.py``)."""
    return get_model_family(model.family).layer_parameters(model)


def root_parameters(model: ModelConfig) -> int:
    """The embedding, the final norm and the LM head (none when tied)."""
    return get_model_family(model.family).root_weights(model)


def parameter_count(config: ModelConfig) -> int:
    """Weights of the model ``config`` builds: every block and the root."""
    return get_model_family(config.family).parameter_count(config)
