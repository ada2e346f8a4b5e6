"""What a resumed run may change: the checkpoint's saved config against this run's, before loading.

Changes to the data stream (which samples each step sees) or to the model's function and shapes are
refused, listing every such key with its old and new value, unless the key is named in
``checkpoint.allow_changes``; accepted and other changes (learning rate, ``train.steps``, layout, ...)
are logged. ``train.steps`` may grow freely: the sample order does not depend on it
(``data/sample_index.py``), so training longer continues the same stream.
"""

from __future__ import annotations

from typing import Any

from cp_train.config import Config
from cp_train.errors import InputError

DATA_STREAM_KEYS = ("train.global_batch_size", "data.seq_len", "data.prefix", "data.tokenizer", "data.seed",
                    "data.valid_fraction", "data.eod_id", "data.mask_eod_loss", "data.reset_position_ids",
                    "data.document_mask")
MODEL_KEYS = ("model.vocab_size", "model.num_layers", "model.hidden_size", "model.num_heads",
              "model.num_kv_heads", "model.ffn_hidden_size", "model.tie_embeddings", "model.rope_theta",
              "model.norm_eps", "model.rope_scaling")
GUARDED_KEYS = DATA_STREAM_KEYS + MODEL_KEYS
QUIET_SECTIONS = ("logging", "checkpoint")  # where a run is written and read: changes are not worth a note


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, current value)}`` for the keys both configs have and that differ."""
    old, new = _flat(saved), _flat(current)
    return {key: (old[key], new[key]) for key in new if key in old and old[key] != new[key]}


def _listing(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


def check_resume(saved: dict[str, Any], config: Config, checkpoint: str) -> list[str]:
    """Raise InputError when ``config`` changes a guarded key of ``saved`` (a checkpoint's config) that
    ``checkpoint.allow_changes`` does not name; return the notes to log about the other changes."""
    changes = config_changes(saved, config.to_dict())
    allowed = set(config.checkpoint.allow_changes)
    refused = {k: v for k, v in changes.items() if k in GUARDED_KEYS and k not in allowed}
    if refused:
        raise InputError(
            f"checkpoint {checkpoint} was saved with another data stream or model: {_listing(refused)}; "
            f"resume with the saved values, start a new run (another --save), or accept the change with "
            f"--set checkpoint.allow_changes={','.join(refused)}")
    accepted = {k: v for k, v in changes.items() if k in GUARDED_KEYS}
    others = {k: v for k, v in changes.items() if k not in GUARDED_KEYS and k.split(".")[0] not in QUIET_SECTIONS}
    notes = []
    if accepted:
        notes.append(f"accepted changes since the checkpoint (checkpoint.allow_changes): {_listing(accepted)}")
    if others:
        notes.append(f"changed since the checkpoint: {_listing(others)}")
    return notes
