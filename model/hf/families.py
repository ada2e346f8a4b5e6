"""The Hugging Face architectures the model reads and writes, and how each spells the attention options.

- ``LlamaForCausalLM``: ``attention_bias`` (q, k, v, o), ``head_dim``; no sliding windows.
- ``MistralForCausalLM``: ``head_dim``; every layer slides when ``sliding_window`` is set.
- ``Qwen2ForCausalLM``: q, k, v biases (o none), ``head_dim``; windows only with ``use_sliding_window``, on the
  ``layer_types`` layers, else on layers >= ``max_window_layers``.
- ``Qwen3ForCausalLM``: qk-norm, ``attention_bias``, ``head_dim`` (default 128); windows as Qwen2.
- ``GraniteSWAForCausalLM``: learned sinks, ``attention_bias``, neutral multipliers only; ``layer_types``
  (default: every 4th layer full).

``attention_fields(hf, architecture, source)`` gives the ``ModelConfig`` attention fields of a config (errors
name the field transformers would read differently); ``choose_architecture(config)`` the class an export
writes (the one the model came from, granite_swa for sinks) and ``attention_config`` its fields.
"""

from __future__ import annotations

import json
from typing import Any

from cp_train.model.config import ModelConfig

LLAMA, MISTRAL, QWEN2, QWEN3, GRANITE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                         "Qwen3ForCausalLM", "GraniteSWAForCausalLM")
MODEL_TYPES = {LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3", GRANITE: "granite_swa"}
ALIASES = {"GraniteSwaForCausalLM": GRANITE}  # the spelling some configs and documents use
GRANITE_MULTIPLIERS = ("embedding_multiplier", "logits_scaling", "residual_multiplier")
FAMILY_DEFAULTS = {  # transformers' defaults of fields a config.json may omit, where they differ from Llama's
    MISTRAL: {"max_position_embeddings": 131072}, QWEN2: {"max_position_embeddings": 32768},
    QWEN3: {"max_position_embeddings": 32768},
    GRANITE: {"max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}}


class HFConfigError(ValueError):
    """A Hugging Face config the model cannot load; the message names the file and the field."""


def unsupported(source: str, field: str, value: Any, why: str) -> HFConfigError:
    return HFConfigError(f"{source}: {field} = {json.dumps(value)} is not supported: {why}")


def architecture_of(hf: dict[str, Any], source: str) -> str:
    """The supported class ``hf`` describes (from ``architectures``, else ``model_type``); ``HFConfigError`` else."""
    architectures, model_type = hf.get("architectures"), hf.get("model_type")
    by_type = {kind: name for name, kind in MODEL_TYPES.items()}
    known = [ALIASES.get(a, a) for a in architectures or () if ALIASES.get(a, a) in MODEL_TYPES]
    found = known[0] if known else by_type.get(model_type) if architectures is None else None
    if model_type is None and architectures is None:
        found = LLAMA  # a bare Llama-shaped config
    if found is None or (model_type is not None and MODEL_TYPES[found] != model_type):
        raise HFConfigError(f"{source}: architectures {architectures} (model_type {model_type!r}) is not a supported "
                            f"causal LM: only {', '.join(MODEL_TYPES)} checkpoints can be loaded")
    return found


def _flag(hf: dict[str, Any], name: str, source: str) -> bool:
    value = hf.get(name, False)
    if not isinstance(value, bool):
        raise HFConfigError(f"{source}: {name} must be true or false, got {json.dumps(value)}")
    return value


def _window(hf: dict[str, Any], source: str, default: int | None = None) -> int | None:
    window = hf.get("sliding_window", default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise HFConfigError(f"{source}: sliding_window must be an integer >= 1 or null, got {json.dumps(window)}")
    return window


def _layer_types(hf: dict[str, Any], layers: int, source: str) -> list[str] | None:
    kinds = hf.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or len(kinds) != layers or \
            any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
        raise unsupported(source, "layer_types", kinds, f"one of full_attention / sliding_attention per layer "
                                                        f"({layers}) is")
    return kinds


def _windows(kinds: list[str] | None, window: int | None) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` of a model whose layers are ``kinds`` with window ``window``."""
    if window is None or kinds is None or "sliding_attention" not in kinds:
        return {"layer_types": None, "sliding_window": None}
    if all(kind == "sliding_attention" for kind in kinds):
        return {"layer_types": None, "sliding_window": window}
    return {"layer_types": list(kinds), "sliding_window": window}


def attention_fields(hf: dict[str, Any], architecture: str, source: str) -> dict[str, Any]:
    """The ``ModelConfig`` attention fields of a config of ``architecture`` (its family's defaults filled in)."""
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or (128 if architecture == QWEN3 and "head_dim" not in hf else None)
    head_dim = head_dim or hf["hidden_size"] // heads
    fields = {"head_dim": head_dim, "qkv_bias": False, "attention_bias": False, "qk_norm": False,
              "attention_sinks": False, "hf_architecture": architecture, "layer_types": None, "sliding_window": None}
    if _flag(hf, "mlp_bias", source):
        raise unsupported(source, "mlp_bias", True, "the MLP has no biases")
    if architecture in (LLAMA, QWEN3, GRANITE):
        fields["attention_bias"] = _flag(hf, "attention_bias", source)
    elif _flag(hf, "attention_bias", source):
        raise unsupported(source, "attention_bias", True, f"{architecture} ignores it (its biases are fixed)")
    fields["qkv_bias"] = architecture == QWEN2
    fields["qk_norm"] = architecture == QWEN3
    kinds = _layer_types(hf, layers, source)
    if architecture == LLAMA:
        for name in ("sliding_window", "use_sliding_window"):
            if hf.get(name):
                raise unsupported(source, name, hf[name], "LlamaForCausalLM has full causal attention only "
                                                          "(Mistral, Qwen2, Qwen3 have sliding windows)")
        if kinds and "sliding_attention" in kinds:
            raise unsupported(source, "layer_types", kinds, "LlamaForCausalLM has full causal attention only")
    elif architecture == MISTRAL:
        window = _window(hf, source)
        if kinds is not None and window is not None and "full_attention" in kinds:
            raise unsupported(source, "layer_types", kinds, "MistralForCausalLM ignores it: every layer has the "
                                                            "sliding window")
        fields.update(_windows(["sliding_attention"] * layers, window))
    elif architecture in (QWEN2, QWEN3):
        window = _window(hf, source) if _flag(hf, "use_sliding_window", source) else None
        first = hf.get("max_window_layers", 28)
        kinds = kinds or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        fields.update(_windows(kinds, window))
    else:
        fields.update(_granite(hf, head_dim, source), attention_sinks=True)
        kinds = kinds or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
        fields.update(_windows(kinds, _window(hf, source, 128)))
    return fields


def _granite(hf: dict[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """Check that a granite_swa config's multipliers and per-layer RoPE are neutral (what the model computes)."""
    for name in GRANITE_MULTIPLIERS:
        if hf.get(name, 1.0) != 1.0:
            raise unsupported(source, name, hf[name], "the model computes granite_swa with neutral multipliers (1.0)")
    scale = hf.get("attention_multiplier", 1.0)
    if abs(scale - head_dim**-0.5) > 1e-12 * head_dim**-0.5:
        raise unsupported(source, "attention_multiplier", scale, f"the model's softmax scale is head_dim ** -0.5 = "
                                                                 f"{head_dim**-0.5!r}")
    thetas = hf.get("layer_rope_theta")
    if thetas is not None and (len(set(thetas)) > 1 or not thetas[0]):
        raise unsupported(source, "layer_rope_theta", thetas, "every layer uses the one rope_theta (no NoPE layers)")
    return {"rope_theta": float(thetas[0])} if thetas else {}


def choose_architecture(config: ModelConfig) -> str:
    """The class an export of ``config`` writes: granite_swa with sinks, else the one it came from, else the
    simplest that represents it. ``HFConfigError`` naming the field when that class cannot represent it exactly."""
    if config.attention_sinks:
        architecture = GRANITE
    elif config.hf_architecture is not None:
        architecture = ALIASES.get(config.hf_architecture, config.hf_architecture)
    elif config.qk_norm:
        architecture = QWEN3
    elif config.qkv_bias and not config.attention_bias:
        architecture = QWEN2
    elif config.layer_types is not None and "sliding_attention" in config.layer_types:
        architecture = QWEN2
    else:
        architecture = MISTRAL if config.sliding_window is not None else LLAMA
    _check_representable(config, architecture)
    return architecture


def _check_representable(config: ModelConfig, architecture: str) -> None:
    source = f"model.{architecture}"
    if architecture not in MODEL_TYPES:
        raise HFConfigError(f"model.hf_architecture {architecture!r} is not one of {', '.join(MODEL_TYPES)}")
    windows = config.windows
    mixed = len(set(windows)) > 1
    rules = [  # (field, value, whether the architecture represents it exactly)
        ("attention_sinks", True, not config.attention_sinks or architecture == GRANITE),
        ("qk_norm", config.qk_norm, config.qk_norm == (architecture == QWEN3)),
        ("qkv_bias", config.qkv_bias, not (config.qkv_bias and not config.attention_bias) or architecture == QWEN2),
        ("attention_bias", config.attention_bias, not config.attention_bias or architecture in (LLAMA, QWEN3, GRANITE)),
        ("layer_types", config.layer_types, not mixed or architecture in (QWEN2, QWEN3, GRANITE)),
        ("sliding_window", config.sliding_window, windows[0] is None or architecture != LLAMA),
        ("head_dim", config.head_dim, architecture != LLAMA or config.hidden_size % config.num_heads == 0),
    ]
    if architecture == QWEN2 and not config.qkv_bias:
        rules.append(("qkv_bias", False, False))
    for field, value, ok in rules:
        if not ok:
            raise unsupported(source, f"model.{field}", value, f"{architecture} cannot represent it exactly")


def attention_config(config: ModelConfig, architecture: str) -> dict[str, Any]:
    """The HF config fields of ``architecture`` that spell ``config``'s attention options."""
    out: dict[str, Any] = {"head_dim": config.head_dim}
    if architecture in (LLAMA, QWEN3, GRANITE):
        out["attention_bias"] = config.attention_bias
    if architecture == LLAMA:
        out["mlp_bias"] = False
    kinds = ["sliding_attention" if w is not None else "full_attention" for w in config.windows]
    if architecture == MISTRAL:
        out["sliding_window"] = config.sliding_window if config.windows[0] is not None else None
    elif architecture in (QWEN2, QWEN3):
        sliding = "sliding_attention" in kinds
        out.update(use_sliding_window=sliding, sliding_window=config.sliding_window if sliding else None,
                   max_window_layers=config.num_layers, layer_types=kinds)
    elif architecture == GRANITE:
        out.update({name: 1.0 for name in GRANITE_MULTIPLIERS}, attention_multiplier=config.head_dim**-0.5,
                   sliding_window=config.sliding_window, layer_types=kinds)
    return out
