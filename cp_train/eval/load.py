"""The model to evaluate: a DCP checkpoint (any layout it was saved in, resharded to this one) or a Hugging
Face Llama directory, on the current parallel state.

``eval_config`` layers the config as training does, on top of what the source says: a checkpoint's saved
config (without its ``checkpoint.*`` and ``logging.*`` keys and its layout's sizes: tp, cp, dp, ulysses_size and
fsdp come from this command's flags) or the HF model's ``config.json`` (``checkpoint.init_from_hf``), then
``--config``, the flags and ``--set``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cp_train import build
from cp_train.checkpoint.files import find_checkpoint, read_meta
from cp_train.checkpoint.weights import load_dcp_weights
from cp_train.config.hf_init import check_hf_weights
from cp_train.config.schema import Config
from cp_train.config.sources import build_config, flatten, parse_override, read_yaml
from cp_train.errors import InputError
from cp_train.model.gpt import GPTModel
from cp_train.parallel.mesh.state import ParallelState

# a checkpoint's keys the evaluation does not inherit: where it was written, and its layout's sizes (DCP reshards)
DROPPED = ("checkpoint.", "logging.", "parallel.tp", "parallel.cp", "parallel.dp", "parallel.ulysses_size",
           "parallel.fsdp")
KEPT = ("parallel.cp_layout", "parallel.cp_algorithm")


def is_hf_dir(path: Path) -> bool:
    """An HF model directory: a ``config.json`` and no cp-train checkpoint metadata."""
    return (path / "config.json").is_file() and not (path / "meta.json").is_file()


def checkpoint_path(load: str) -> Path:
    """The complete checkpoint ``load`` names (a save directory's latest, or one ``step_*`` directory)."""
    if not Path(load).is_dir():
        raise InputError(f"--load {load} is not a directory: pass a DCP checkpoint directory (checkpoint.save or "
                         f"one of its step_* directories) or a Hugging Face model directory")
    path = find_checkpoint(load, use="evaluate the newest complete checkpoint instead: {}")
    if path is None:
        raise InputError(f"--load {load} holds no complete checkpoint and no Hugging Face config.json")
    return path


def eval_config(load: str, config_file: str | None, flags: dict[str, Any], overrides: list[str]) -> Config:
    """The evaluation's config (see the module docstring); ``flags`` are dotted keys."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if is_hf_dir(Path(load)):
        hf = {"checkpoint.init_from_hf": load}
        if (Path(load) / "tokenizer.json").is_file():
            hf["data.tokenizer"] = load
        layers.append((f"--load {load}", hf))
    else:
        saved = flatten(read_meta(checkpoint_path(load))["config"], f"--load {load}")
        kept = {k: v for k, v in saved.items() if k in KEPT or not k.startswith(DROPPED)}
        layers.append((f"--load {load}", kept))
    if config_file:
        layers.append((config_file, flatten(read_yaml(Path(config_file)), config_file)))
    layers.append(("command-line flags", flags))
    layers.append(("--set", dict(parse_override(o) for o in overrides)))
    return build_config(layers)


def load_model(config: Config, state: ParallelState, load: str, device: torch.device) -> GPTModel:
    """The model of ``load`` on this rank's groups (in eval mode): HF weights, or a DCP checkpoint's."""
    hf_dir = load if is_hf_dir(Path(load)) else None
    if hf_dir is not None:
        check_hf_weights(hf_dir, config.model)
    model, _ = build.build_model(config, state, device, hf_dir)
    if hf_dir is None:
        load_dcp_weights(model, checkpoint_path(load), state)
    return model.eval()
