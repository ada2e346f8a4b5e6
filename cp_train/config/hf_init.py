"""``checkpoint.init_from_hf``: a run whose model shape comes from a Hugging Face Llama's ``config.json``.

``apply_hf_model(config)`` (called when the config is built) copies the architecture fields
(vocab, layers, hidden, heads, kv heads, ffn, ``rms_norm_eps``, tied embeddings, and the attention options:
head_dim, biases, qk-norm, layer types, sliding window, sinks) and the HF class into ``config.model``;
a ``model.*`` key the user set to another value is an error listing every such
key. The RoPE fields (``max_position_embeddings``, ``rope_theta``, ``rope_scaling``) are taken from
the HF config unless the user set them: that is how a context extension is configured. A user
``rope_scaling`` of type llama3 or yarn without ``original_max_position_embeddings`` gets the HF
model's ``max_position_embeddings`` (the context it was trained at). The weights are loaded by
``build.build_model`` when the run does not resume from a DCP checkpoint (``check_hf_weights`` checks them
before). Keys of a default config (no ``--config``: the CPU demo's) are not the user's: ``hf_model_keys`` are
dropped from it first (``flags.py``).
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from cp_train.config.schema import Config, ConfigError
from cp_train.errors import InputError, one_line
from cp_train.model.config import ModelConfig
from cp_train.model.hf.config import (
    ARCHITECTURE_FIELDS,
    ATTENTION_FIELDS,
    ROPE_FIELDS,
    HFConfigError,
    model_fields,
    read_hf_config,
)


def hf_model_keys() -> frozenset[str]:
    """The ``model.*`` keys a Hugging Face config.json sets (its shape, attention options and RoPE fields): a
    default config's values of these give way to ``--init-from-hf`` (``flags.parse_args``)."""
    return frozenset(f"model.{name}" for name in (*ARCHITECTURE_FIELDS, *ATTENTION_FIELDS, *ROPE_FIELDS,
                                                  "hf_architecture"))


def user_model_keys(config: Config) -> set[str]:
    """``model.*`` field names a config layer (YAML, flag, ``--set``) set to a value other than null."""
    keys = {key.split(".", 1)[1] for key in config.explicit_keys if key.startswith("model.")}
    return {name for name in keys if getattr(config.model, name, None) is not None}


def apply_hf_model(config: Config) -> None:
    """Set ``config.model`` from ``checkpoint.init_from_hf``'s config.json (the RoPE fields the user set stay).

    Raises ``ConfigError`` for an unreadable or unsupported HF config, or for conflicting ``model.*`` keys.
    """
    path = config.checkpoint.init_from_hf
    try:
        fields = model_fields(read_hf_config(path))
    except (FileNotFoundError, HFConfigError) as error:
        raise ConfigError(f"checkpoint.init_from_hf: {error}") from None
    model, user = config.model, user_model_keys(config)
    shape = {**ARCHITECTURE_FIELDS, **{name: name for name in ATTENTION_FIELDS}}
    conflicts = [f"model.{name}={getattr(model, name)!r} (config.json {hf_name}: {fields[name]!r})"
                 for name, hf_name in shape.items() if name in user and getattr(model, name) != fields[name]]
    if conflicts:
        raise ConfigError(f"checkpoint.init_from_hf={path} takes the model's shape from {path}/config.json, but "
                          f"these keys were set to other values: {', '.join(conflicts)}; remove them from the "
                          f"config and the command line")
    for name in (*shape, "hf_architecture"):
        setattr(model, name, fields[name])
    for name in ROPE_FIELDS:
        if name not in user:
            setattr(model, name, fields[name])
    scaling = model.rope_scaling
    if "rope_scaling" in user and scaling and (scaling.get("rope_type") or scaling.get("type")) in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])


def hf_init_message(config: Config) -> str:
    """The log line of a run initialised from ``checkpoint.init_from_hf``, naming the RoPE fields set here."""
    model, kept = config.model, sorted(user_model_keys(config) & set(ROPE_FIELDS))
    text = f"initialised from the Hugging Face model {config.checkpoint.init_from_hf}"
    if kept:
        text += "; set here instead of its config.json: " + ", ".join(f"model.{k}={getattr(model, k)}" for k in kept)
    return text


def check_hf_weights(path: str | Path, model: ModelConfig) -> None:
    """InputError naming directory ``path`` unless its safetensors weights are there, readable (each file's header
    parses and the file is as long as it says) and hold every tensor ``model`` needs: checked before the model is
    built, where loading them would fail only at its end."""
    from cp_train.model.hf.weights import SINGLE_FILE, WeightFiles, hf_tensors  # torch: only with weights to read

    reading = Path(path) / SINGLE_FILE  # the file a SafetensorError is about
    try:
        files = WeightFiles(path)
        for reading in sorted(set(files.files.values())):
            with safe_open(reading, framework="pt"):
                pass
    except (OSError, ValueError, SafetensorError) as error:
        problem = (f"{reading.name} is truncated or not a safetensors file ({one_line(str(error))})"
                   if isinstance(error, SafetensorError) else one_line(str(error)))
        raise InputError(f"checkpoint.init_from_hf (--init-from-hf) {path}: {problem}: its weights are missing or "
                         f"damaged; re-download or re-export the model into it") from None
    missing = [entry.name for entry in hf_tensors(model) if entry.name not in files.files]
    if missing:
        raise InputError(f"checkpoint.init_from_hf (--init-from-hf) {path}: its weights lack {len(missing)} tensors "
                         f"its config.json implies ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                         f"re-download or re-export the model into it")
