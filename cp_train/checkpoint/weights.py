"""A cp-train checkpoint's model weights alone, into a model of any layout: the evaluation's model, and a new run's
start (``checkpoint.init_from``; Megatron-LM's ``--finetune``, torchtitan's model-only load).

``init_source`` finds the checkpoint and checks that its model has this run's shape (the keys that size a weight);
RoPE's settings may differ (a long-context stage raises ``rope_theta``), each said in a note. ``load_dcp_weights``
copies the weights into this rank's shards, DCP resharding them from the layout they were saved in.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from cp_train.checkpoint.dcp import ShardedState
from cp_train.checkpoint.files import find_checkpoint, read_meta
from cp_train.checkpoint.legacy import loading_view
from cp_train.checkpoint.resume import config_changes
from cp_train.config.schema import Config
from cp_train.errors import InputError
from cp_train.model.gpt import GPTModel
from cp_train.model.shards import local_tensor
from cp_train.parallel.mesh.state import ParallelState

# the model keys that size a weight: a checkpoint of another value does not load
SHAPE_KEYS = ("model.vocab_size", "model.num_layers", "model.hidden_size", "model.num_heads", "model.num_kv_heads",
              "model.ffn_hidden_size", "model.head_dim", "model.tie_embeddings", "model.qkv_bias",
              "model.attention_bias", "model.qk_norm", "model.attention_sinks")
INIT_KEY = "checkpoint.init_from (--init-from)"


def init_source(path: str, config: Config, share: tuple[int, int] | None = None) -> tuple[Path, list[str]]:
    """The complete checkpoint ``path`` names (a save directory's latest, or one ``step_*``) and the notes to log;
    InputError when there is none, or when its model has another shape than ``config``'s."""
    found = find_checkpoint(path, use="start from the newest complete checkpoint instead: --init-from {}", share=share)
    if found is None:
        raise InputError(f"{INIT_KEY} {path} holds no checkpoint (no `latest`, no step_* directory named): pass a "
                         f"checkpoint.save directory or one of its step_* directories")
    meta = read_meta(found)
    changes = {key: change for key, change in config_changes(meta["config"], config.to_dict()).items()
               if key.startswith("model.")}
    shape = {key: change for key, change in changes.items() if key in SHAPE_KEYS}
    if shape:
        listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in shape.items())
        fix = " ".join(f"--set {key}={old}" for key, (old, _) in shape.items())
        raise InputError(f"{INIT_KEY} {found} holds a model of another shape: {listed}; set them as saved ({fix})")
    others = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
    notes = [f"initialised from the weights of checkpoint {found} (step {meta['step']}), resharded to this layout: a "
             f"new run from step 0, with a fresh optimizer, schedule and data stream"]
    return found, notes + ([f"changed since that checkpoint: {others}"] if others else [])


@torch.no_grad()
def load_dcp_weights(model: GPTModel, path: Path, state: ParallelState) -> None:
    """Copy the model part of DCP checkpoint ``path`` into ``model``'s local shards (resharded by DCP)."""
    sharded = ShardedState(model, None, state)  # type: ignore[arg-type]  # the model part only: no optimizer
    target = {"model": {k: sharded._wrap(k, v) for k, v in get_model_state_dict(model).items()}}
    reader = dcp.FileSystemReader(path)
    to_load, split = loading_view(path, reader, model.config.ffn_hidden_size, target)  # ``legacy.py``
    try:
        dcp.load(to_load, storage_reader=reader)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        raise InputError(f"checkpoint {path} does not load into this model ({str(error).splitlines()[0]})") from None
    if split is not None:
        split.write_back()
    for name, param in model.named_parameters():
        source, destination = local_tensor(target["model"][name]), local_tensor(param)
        if source.data_ptr() != destination.data_ptr():
            destination.copy_(source)
