"""Hugging Face ``config.json`` <-> ``ModelConfig`` (plain json; no transformers at run time).

``read_hf_config(dir)`` reads and checks a config: it must describe a Llama, Mistral, Qwen2, Qwen3 or
granite_swa causal LM (``families.py``) whose every field the model can represent. Fields the model cannot
represent (MLP biases, an activation other than SiLU, partial rotary, dropout, quantized weights, unknown or
``dynamic`` RoPE types, a field its family reads differently) are errors naming the file and the field.
``model_fields(hf)`` gives the ``ModelConfig`` fields it fixes (HF's ``rms_norm_eps``, ``rope_theta``,
``rope_scaling`` / ``rope_parameters``, ``tie_word_embeddings``, ``max_position_embeddings``, the attention
options and the architecture copied, HF's defaults where a field is absent), and ``hf_config(config)`` writes a
config of the architecture the model came from that transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cp_train.model.config import ModelConfig
from cp_train.model.hf.families import (
    FAMILY_DEFAULTS,
    MODEL_TYPES,
    HFConfigError,
    architecture_of,
    attention_config,
    attention_fields,
    choose_architecture,
    unsupported,
)
from cp_train.model.hf.rope_scaling import resolve_rope_scaling

__all__ = ["HFConfigError", "check_hf", "hf_config", "model_fields", "read_hf_config"]

CONFIG_FILE = "config.json"
ARCHITECTURE = "LlamaForCausalLM"  # the default architecture of a config that names none
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": False}
ARCHITECTURE_FIELDS = {  # ModelConfig field -> HF field: the shape of the weights
    "vocab_size": "vocab_size", "num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
ATTENTION_FIELDS = ("head_dim", "qkv_bias", "attention_bias", "qk_norm", "layer_types", "sliding_window",
                    "attention_sinks")  # ModelConfig fields of the attention a HF config fixes too
ROPE_FIELDS = ("max_position_embeddings", "rope_theta", "rope_scaling")  # may be changed to extend the context


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` (``path`` a model directory, or the file itself) as a dict, checked by ``check_hf``."""
    path = Path(path)
    file = path if path.is_file() else path / CONFIG_FILE
    if not file.is_file():
        where = "is not a directory" if not path.exists() else f"has no {CONFIG_FILE}"
        raise FileNotFoundError(f"{path} {where}: a Hugging Face model directory holds {CONFIG_FILE} and "
                                f"model.safetensors (or model.safetensors.index.json and its shards)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise HFConfigError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(hf, dict):
        raise HFConfigError(f"{file} must hold a JSON object")
    check_hf(hf, str(file))
    return hf


_unsupported = unsupported


def _defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers' defaults for the fields ``hf`` may omit, of its architecture."""
    return {**HF_DEFAULTS, **FAMILY_DEFAULTS.get(architecture_of(hf, CONFIG_FILE), {})}


def check_hf(hf: dict[str, Any], source: str = CONFIG_FILE) -> None:
    """Raise ``HFConfigError`` naming ``source`` and the field unless the model can represent ``hf`` exactly."""
    architecture = architecture_of(hf, source)
    missing = [name for name in REQUIRED if name not in hf]
    if missing:
        raise HFConfigError(f"{source} lacks {', '.join(missing)}")
    for name in REQUIRED + ("num_key_value_heads", "max_position_embeddings"):
        value = hf.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HFConfigError(f"{source}: {name} must be an integer >= 1, got {json.dumps(value)}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2
                                 or head_dim % 2):
        raise _unsupported(source, "head_dim", head_dim, "head_dim must be an even integer >= 2 for RoPE")
    for name in ("hidden_act", "hidden_activation"):
        if hf.get(name, "silu") != "silu":
            raise _unsupported(source, name, hf[name], "the MLP is SwiGLU (silu)")
    for name in ("qk_norm", "use_qk_norm", "qk_layernorm"):
        if hf.get(name):
            raise _unsupported(source, name, hf[name], f"{architecture} has no such query/key norms "
                                                       f"(Qwen3ForCausalLM's are implied by its class)")
    attention_fields(hf, architecture, source)
    if hf.get("attention_dropout"):
        raise _unsupported(source, "attention_dropout", hf["attention_dropout"], "the model has no dropout; set 0.0")
    if hf.get("quantization_config") is not None:
        raise _unsupported(source, "quantization_config", hf["quantization_config"], "weights must be unquantized")
    _rope(hf, source)


check_llama = check_hf  # the name before the other families


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of an HF config: v4 (``rope_theta``, ``rope_scaling``) or v5
    (``rope_parameters``) fields; ``rope_scaling`` wins over ``rope_parameters`` as in transformers."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    raw = dict(hf.get(field) or {})
    theta = raw.pop("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    partial = raw.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(source, "partial_rotary_factor", partial, "RoPE rotates the whole head")
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 1:
        raise HFConfigError(f"{source}: rope_theta must be a number > 1, got {json.dumps(theta)}")
    max_positions = hf.get("max_position_embeddings", _defaults(hf)["max_position_embeddings"])
    try:
        scaling = resolve_rope_scaling(raw or None, max_positions)
    except ValueError as error:
        raise HFConfigError(f"{source}: {field}: {error}") from None
    if scaling is not None:  # keep HF's fields as written, with the original context made explicit
        raw = {key: value for key, value in raw.items() if key != "type"}
        raw = {"rope_type": scaling["rope_type"], **raw}
        if "original_max_position_embeddings" in scaling:
            raw["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return float(theta), raw if scaling is not None else None


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields a (checked) HF config fixes."""
    theta, scaling = _rope(hf, CONFIG_FILE)
    defaults = _defaults(hf)
    fields = {ours: hf.get(theirs, defaults.get(theirs)) for ours, theirs in ARCHITECTURE_FIELDS.items()}
    if fields["num_kv_heads"] is None:
        fields["num_kv_heads"] = hf["num_attention_heads"]
    fields["norm_eps"] = float(fields["norm_eps"])
    fields["tie_embeddings"] = bool(fields["tie_embeddings"])
    fields.update(max_position_embeddings=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
                  rope_theta=theta, rope_scaling=scaling)
    fields.update(attention_fields(hf, architecture_of(hf, CONFIG_FILE), CONFIG_FILE))
    return fields


def hf_config(config: ModelConfig, dtype: str = "float32", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``config`` that ``transformers.AutoModelForCausalLM`` loads as the same model, of the
    architecture ``families.choose_architecture`` picks (``HFConfigError`` naming the field when none is exact).

    ``extra`` (e.g. ``bos_token_id``, ``eos_token_id``) is merged in; ``rope_scaling`` is written resolved
    (every default explicit), so any transformers version reads the same scaling.
    """
    scaling = resolve_rope_scaling(config.rope_scaling, config.max_position_embeddings)
    architecture = choose_architecture(config)
    out = {"architectures": [architecture], "model_type": MODEL_TYPES[architecture], "vocab_size": config.vocab_size,
           "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
           "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
           "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
           "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_eps,
           "rope_theta": config.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": config.tie_embeddings,
           "attention_dropout": 0.0, "initializer_range": config.init_std, "torch_dtype": dtype}
    out.update(attention_config(config, architecture))
    out.update(extra or {})
    return out
