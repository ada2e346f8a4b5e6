"""Export a training checkpoint (DCP, any tp/cp/dp layout) as a Hugging Face model directory: the architecture
the model came from (``model.hf_architecture``: Llama, Mistral, Qwen2, Qwen3), granite_swa for a model with
sinks, Llama by default; a model no architecture represents exactly is refused, naming the field.

    cp-train-export-hf CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--tokenizer-from HF_DIR]

``CHECKPOINT_DIR`` is a run's checkpoint directory (its ``latest``) or one ``step_*`` directory. The
model shape comes from the checkpoint's ``meta.json``; each tensor is read at full shape straight
from the DCP files (one at a time, in one process, no torch.distributed), so the saving layout does
not matter. OUT_DIR gets ``config.json`` and safetensors that ``transformers`` loads, plus the
tokenizer files and token ids of ``--tokenizer-from`` (default: the run's ``checkpoint.init_from_hf``
directory when it still exists).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from cp_train.checkpoint.dcp import META, find_checkpoint
from cp_train.checkpoint.files import newest_complete
from cp_train.checkpoint.legacy import old_names, stored_apart
from cp_train.errors import InputError, ensure_writable_dir
from cp_train.model.config import ModelConfig, gate_up_block
from cp_train.model.hf.llama import DEFAULT_SHARD_BYTES, write_hf_model
from cp_train.model.hf.weights import hf_tensors
from cp_train.model.mlp import pair_gate_up

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
TOKENIZERS = ("tokenizer.json", "tokenizer.model")  # a directory holding neither has no tokenizer to copy
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # train.dtype's names too


def checkpoint_model_config(meta: dict[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` a checkpoint's ``meta.json`` recorded (fields unknown to this version ignored)."""
    saved = meta["config"]["model"]
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


def check_tokenizer_from(given: str | None) -> None:
    """InputError unless ``--tokenizer-from`` (when given) is a directory with a tokenizer."""
    if given is not None and not any((Path(given) / name).is_file() for name in TOKENIZERS):
        what = "holds no tokenizer" if Path(given).is_dir() else "is not a directory"
        raise InputError(f"--tokenizer-from {given} {what}: pass a Hugging Face model directory with "
                         f"{' or '.join(TOKENIZERS)} (and tokenizer_config.json), or leave the flag out")


def _tokenizer_source(meta: dict[str, Any], given: str | None) -> Path | None:
    """``--tokenizer-from``, else the run's ``checkpoint.init_from_hf`` when it still exists."""
    if given is not None:
        return Path(given)
    origin = meta["config"].get("checkpoint", {}).get("init_from_hf")
    return Path(origin) if origin and Path(origin).is_dir() else None


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                      tokenizer_from: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model of ``checkpoint`` as an HF model directory ``out``; ``dtype`` None keeps the stored one."""
    check_tokenizer_from(tokenizer_from)
    if not Path(checkpoint).is_dir():
        raise InputError(f"{checkpoint} is not a directory: pass a run's checkpoint directory (checkpoint.save) or "
                         f"one of its step_* directories")
    path = find_checkpoint(checkpoint, use="export the newest complete checkpoint instead: {}")
    if path is None:
        newest = newest_complete(Path(checkpoint))
        hint = f": export its newest complete checkpoint, {newest}" if newest else ""
        raise InputError(f"{checkpoint} holds no complete checkpoint (no {META}, no `latest`){hint}")
    meta = json.loads((path / META).read_text())
    config = checkpoint_model_config(meta)
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    apart = stored_apart(stored)  # saved while gate and up were two weights (``legacy.py``): interleaved here
    block = gate_up_block(config.ffn_hidden_size)
    shapes = {}
    for entry in hf_tensors(config):
        for name in (old_names(entry.param) if apart else None) or (entry.param,):
            if f"model.{name}" not in stored:
                raise ValueError(f"{path} has no tensor model.{name}: not a checkpoint of the model its {META} "
                                 f"describes")
            shapes[name] = stored[f"model.{name}"]

    def stored_tensor(name: str) -> torch.Tensor:
        info = shapes[name]
        tensor = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        with warnings.catch_warnings():  # one process on purpose: DCP's "assuming a single process" note
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": {name: tensor}}, storage_reader=FileSystemReader(path), no_dist=True)
        return tensor

    def full(name: str) -> torch.Tensor:
        names = old_names(name) if apart else None
        return stored_tensor(name) if names is None else pair_gate_up(*(stored_tensor(old) for old in names), block)

    source = _tokenizer_source(meta, tokenizer_from)
    if source is not None and Path(out).resolve() == source.resolve():
        raise InputError(f"{out} is the tokenizer source (--tokenizer-from, or the run's checkpoint.init_from_hf): "
                         f"exporting there would overwrite the model the run started from; pass another directory")
    ensure_writable_dir(Path(out), "the output directory")
    extra = {}
    if source is not None:
        hf = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else {}
        extra = {key: hf[key] for key in TOKEN_IDS if key in hf}
    dtype = dtype or next(iter(shapes.values())).properties.dtype
    out = write_hf_model(config, out, full, dtype, max_shard_bytes=max_shard_bytes, extra_config=extra)
    for name in TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out
