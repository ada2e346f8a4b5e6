"""Resuming a run: what may change against the checkpoint's saved config, and restoring the run's state.

Changes to the data stream (which samples each step sees) or to the model's function and shapes are
refused, listing every such key with its old and new value, unless the key is named in
``checkpoint.allow_changes``; accepted and other changes (learning rate, ``train.steps``, layout, ...)
are logged (``model.fp8`` on its own line: a bf16 run resumes in FP8 and back). ``train.steps`` may grow
freely: the sample order does not depend on it (``cp_train.data.sample_index``), so training longer continues
the same stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cp_train.checkpoint.dcp import ShardedState, load_checkpoint, read_meta
from cp_train.checkpoint.files import STEP_DIR, is_complete, step_dirs
from cp_train.checkpoint.rng import derived_seed, restore_rng_state, seed_everything
from cp_train.config.schema import Config
from cp_train.errors import InputError
from cp_train.optim import LRSchedule, continue_schedule, saved_schedule
from cp_train.parallel.mesh.state import ParallelState

DATA_STREAM_KEYS = ("train.global_batch_size", "data.seq_len", "data.prefix", "data.tokenizer", "data.seed",
                    "data.valid_fraction", "data.eod_id", "data.mask_eod_loss", "data.reset_position_ids",
                    "data.document_mask")
MODEL_KEYS = ("model.vocab_size", "model.num_layers", "model.hidden_size", "model.num_heads",
              "model.num_kv_heads", "model.ffn_hidden_size", "model.tie_embeddings", "model.rope_theta",
              "model.norm_eps", "model.rope_scaling", "model.head_dim", "model.qkv_bias", "model.attention_bias",
              "model.qk_norm", "model.attention_sinks")
GUARDED_KEYS = DATA_STREAM_KEYS + MODEL_KEYS
# whether it is set decides the training documents (all of data.prefix's, or data.valid_fraction held out); which
# validation data it names does not change the training stream
VALID_PREFIX_KEY = "data.valid_prefix"
QUIET_SECTIONS = ("logging", "checkpoint")  # where a run is written and read: changes are not worth a note
FP8_KEY = "model.fp8"  # how the linears compute: a resume may switch it (its own note)


def check_save_directory(save: str | None, resumed_from: Path | None) -> None:
    """InputError when this run would write over or among checkpoints in ``save`` (checkpoint.save) that it does
    not continue: complete ones past the step it resumes from (``resumed_from``, one of ``save``'s), or any when
    it starts afresh or resumes from elsewhere. Step directories that are not complete (a save cut short) are no
    checkpoints: they are written over."""
    if not save:
        return
    root = Path(save)
    found = [path for path in step_dirs(root) if is_complete(path, verify=False)]
    if not found:
        return
    start = 0 if resumed_from is None else int(read_meta(resumed_from)["step"])
    later = [path.name for path in found if int(STEP_DIR.fullmatch(path.name).group(1)) > start]
    if resumed_from is not None and resumed_from.resolve().parent == root.resolve():
        if later:  # a rollback to an earlier step would overwrite the later ones
            raise InputError(f"checkpoint.save (--save) {save} holds {', '.join(later)}, past step {start} this run "
                             f"resumes from, and it would overwrite them: move them out of {save} to go on from "
                             f"step {start}, resume the newest with --load {root / later[-1]}, or set another --save")
        return
    source = (f"resumes from {resumed_from}: continue {save} with --load {save}" if resumed_from is not None else
              "starts afresh (checkpoint.auto_resume false): resume it (checkpoint.auto_resume true)")
    raise InputError(f"checkpoint.save (--save) {save} holds another run's checkpoints (up to {found[-1].name}) and "
                     f"this run {source}, or set another --save; nothing was written")


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
    guarded = {k for k, (old, new) in changes.items()
               if k in GUARDED_KEYS or (k == VALID_PREFIX_KEY and bool(old) != bool(new))}
    refused = {k: v for k, v in changes.items() if k in guarded and k not in allowed}
    if refused:
        raise InputError(
            f"checkpoint {checkpoint} was saved with another data stream or model: {_listing(refused)}; "
            f"resume with the saved values, start a new run (another --save), or accept the change with "
            f"--set checkpoint.allow_changes={','.join(refused)}")
    accepted = {k: v for k, v in changes.items() if k in guarded}
    others = {k: v for k, v in changes.items() if k not in guarded and k.split(".")[0] not in QUIET_SECTIONS}
    notes = []
    if FP8_KEY in others:  # the same weights either way: said on its own line
        old, new = others.pop(FP8_KEY)
        notes.append(f"{FP8_KEY} {old} -> {new}: the checkpoint's weights and optimizer state load as saved (FP8 "
                     f"changes how the blocks' linears compute, not the fp32 weights they keep)")
    if accepted:
        notes.append(f"accepted changes since the checkpoint (checkpoint.allow_changes): {_listing(accepted)}")
    if others:
        notes.append(f"changed since the checkpoint: {_listing(others)}")
    return notes


def restore_run(path: Path, config: Config, sharded: ShardedState, optimizer: torch.optim.Optimizer,
                state: ParallelState, schedule: LRSchedule | None = None) -> tuple[int, int, list[str]]:
    """Load checkpoint ``path`` into ``sharded`` (model and optimizer, resharded to this layout) after
    ``check_resume``; this run's optimizer settings win over the saved ones, and the RNG is restored (or
    re-derived from ``train.seed`` where it cannot be). ``schedule`` (this run's) continues the checkpoint's
    (``optim.continue_schedule``: the LR stays continuous when ``train.steps`` changed, unless
    ``schedule.restart``). Returns (step, consumed samples, notes to log)."""
    meta = read_meta(path)
    if int(meta["step"]) > config.train.steps:
        raise InputError(f"checkpoint {path} is at step {meta['step']}, beyond train.steps {config.train.steps}: "
                         f"raise --train-steps, or start a new run with another --save")
    changes = check_resume(meta["config"], config, str(path))
    rng_state, why = load_checkpoint(path, meta, sharded, state)
    for group in optimizer.param_groups:
        group.update({k: optimizer.defaults[k] for k in ("foreach", "fused") if k in optimizer.defaults})
        group["betas"] = (config.optimizer.beta1, config.optimizer.beta2)
        group["eps"] = config.optimizer.eps
        if group["weight_decay"]:
            group["weight_decay"] = config.optimizer.weight_decay
    step = int(meta["step"])
    notes = [f"resumed from {path} at step {step}, consumed_samples {meta['consumed_samples']}", *changes]
    if schedule is not None:
        saved = saved_schedule(meta["config"], meta.get("scheduler") or {})
        note = continue_schedule(schedule, saved, step, config.schedule.restart)
        notes += [note] if note else []
    if rng_state is not None:
        restore_rng_state(rng_state)
    else:
        seed_everything(derived_seed(config.train.seed, state.rank, step))
        notes.append(f"{why}: RNG re-derived from train.seed {config.train.seed} at step {step} on every rank")
    return step, int(meta["consumed_samples"]), notes
