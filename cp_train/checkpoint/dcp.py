"""Sharded checkpoints with torch.distributed.checkpoint (DCP) that resume exactly and reshard.

Layout of a checkpoint directory ``ROOT``::

    ROOT/latest                   name of the newest COMPLETE checkpoint (written last, atomically)
    ROOT/step_00000100/.metadata  DCP: model and optimizer, one writer per shard
    ROOT/step_00000100/*.distcp
    ROOT/step_00000100/rng/rank_00003.pt   every rank's RNG states
    ROOT/step_00000100/meta.json  step, consumed_samples, scheduler, layout, config
    ROOT/step_00000100/manifest.json  every file's length and checksum (``integrity.py``), written last

Model and optimizer tensors are saved as DTensors of their full shape on the ``("dp_cp", "tp")`` mesh,
with placements derived from the mesh dims that split each one (``ShardedState``): TP-sharded
parameters (``partition_dim``) ``Shard`` over ``tp``, FSDP-sharded ones ``Shard`` over ``dp_cp``,
replicated elsewhere. DCP writes each shard once and loads them into any other layout (tp, cp, dp),
with FSDP on or off. A crash during a save leaves
``latest`` on the previous checkpoint; the partial directory is ignored (and replaced by the next save).
A save that fails (a full disk, say) raises ``RunFailure`` on every rank naming the directory and the
checkpoint ``latest`` still names. ``files.py`` checks a checkpoint's files (and their checksums) before loading.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from cp_train.checkpoint.files import (  # noqa: F401  (re-exported)
    LATEST,
    META,
    find_checkpoint,
    latest_name,
    newest_complete,
    prune,
    read_meta,
    step_dir_name,
)
from cp_train.checkpoint.integrity import MANIFEST, HashingFileSystem, file_digest, write_manifest
from cp_train.checkpoint.legacy import loading_view, old_param_groups
from cp_train.checkpoint.rng import capture_rng_state
from cp_train.errors import InputError, RunFailure, agree, one_line
from cp_train.model.shards import data_shards, full_shape, local_tensor, tensor_parallel_dim
from cp_train.parallel.mesh.state import ParallelDims, ParallelState

DISK_FULL_MARKERS = ("no space left on device", "disk quota exceeded", "errno 28")


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def checkpoint_placements(mesh_dim_names: tuple[str, ...], shards: dict[str, int]) -> list[Placement]:
    """One placement per mesh dim, by name: ``Shard(dim)`` where ``shards`` splits the tensor over that dim's axis
    (``{"tp": 0, "dp_cp": 1}``, say), ``Replicate()`` elsewhere."""
    return [Shard(shards[name]) if name in shards else Replicate() for name in mesh_dim_names]


class ShardedState:
    """Model and optimizer state as DTensors on ``state.shard_mesh`` (``("dp_cp", "tp")``): the DCP view of
    this rank's shards, at the full shape of every tensor. A parameter's placements come from the mesh dims
    that split it: its TP ``partition_dim`` over ``tp`` (tp > 1), its FSDP shard dim over ``dp_cp``; every other
    dim is replicated. DCP writes each shard once and reshards on load (another layout, FSDP on or off)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState) -> None:
        self.model, self.optimizer, self.mesh = model, optimizer, state.shard_mesh
        self.shapes: dict[str, torch.Size] = {}
        self.placements: dict[str, list[Placement]] = {}
        names = self.mesh.mesh_dim_names or ()
        for name, param in model.named_parameters():
            shards = data_shards(param)
            if state.tp.size > 1 and tensor_parallel_dim(param) is not None:
                shards["tp"] = tensor_parallel_dim(param)  # type: ignore[assignment]
            if len(set(shards.values())) < len(shards):
                raise ValueError(f"parameter {name} is split twice along one dim ({shards}): no 2-D DTensor view")
            self.shapes[name] = full_shape(param, state.tp.size)
            self.placements[name] = checkpoint_placements(names, shards)

    def _wrap(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or name not in self.placements:
            return tensor  # optimizer step counts: replicated plain tensors
        shape = self.shapes[name]
        return DTensor.from_local(local_tensor(tensor), self.mesh, self.placements[name], run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())

    def _init_optimizer_state(self) -> None:
        """Give a fresh optimizer its state tensors (a step with zero gradients at lr 0 changes no parameter),
        so that DCP has tensors to load into. Gradients are zeroed."""
        if self.optimizer.state:
            return
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                else:
                    param.grad.zero_()
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """``{"model": {fqn: DTensor}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]}}``."""
        self._init_optimizer_state()
        model_sd = get_model_state_dict(self.model)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        return {"model": {k: self._wrap(k, v) for k, v in model_sd.items()},
                "optimizer": {"state": {fqn: {k: self._wrap(fqn, v) for k, v in entry.items()}
                                        for fqn, entry in optim_sd["state"].items()},
                              "param_groups": optim_sd["param_groups"]}}

    @torch.no_grad()
    def load_state_dict(self, loaded: dict[str, Any]) -> None:
        """Copy a DCP-loaded ``state_dict()`` back into the model's and the optimizer's local shards."""
        def copy(target: torch.Tensor, value: Any) -> None:
            source, destination = local_tensor(value), local_tensor(target)
            if source.data_ptr() != destination.data_ptr():
                destination.copy_(source)

        for name, param in self.model.named_parameters():
            copy(param, loaded["model"][name])
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        for fqn, entry in optim_sd["state"].items():
            for key, value in entry.items():
                copy(value, loaded["optimizer"]["state"][fqn][key])
        set_optimizer_state_dict(self.model, self.optimizer, {"state": optim_sd["state"],
                                                              "param_groups": loaded["optimizer"]["param_groups"]})


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, the exceptions it wraps (DCP's per-rank failures included), their causes and contexts."""
    found: list[BaseException] = []
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        pending += [current.__cause__, current.__context__]
        pending += [pair[0] for pair in getattr(current, "failures", {}).values() if isinstance(pair, tuple)]
    return found


def _root_message(error: BaseException) -> str:
    """The innermost failure's ``Type: message`` (DCP wraps every rank's exception in one of its own)."""
    inner = [e for e in _causes(error) if type(e).__name__ != "CheckpointException"] or [error]
    return f"{type(inner[-1]).__name__}: {one_line(str(inner[-1]))}"


def _is_disk_full(error: BaseException, directory: Path) -> bool:
    for cause in _causes(error):
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(cause).lower() for marker in DISK_FULL_MARKERS):
            return True
    try:  # torch's zip writer reports a failed write as "unexpected pos": look at the file system
        return shutil.disk_usage(directory).free < 2**20
    except OSError:
        return False


def save_failure(error: BaseException, target: Path, previous: str | None) -> RunFailure:
    """The message for a save of ``target`` that failed with ``error``."""
    kept = f"{target.parent / LATEST} still names {previous}" if previous else "no earlier checkpoint exists"
    if _is_disk_full(error, target.parent):
        try:
            free = f"{shutil.disk_usage(target.parent).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        return RunFailure(f"no space left on device while saving checkpoint {target} ({free} in "
                          f"{target.parent}): free space there, point --save (checkpoint.save) elsewhere or "
                          f"lower checkpoint.keep; {kept}")
    return RunFailure(f"saving checkpoint {target} failed ({_root_message(error)}); {kept}")


def save_checkpoint(root: str | os.PathLike, step: int, sharded: ShardedState, meta: dict[str, Any],
                    state: ParallelState, keep: int = 0) -> Path:
    """Save on every rank (collective); ``latest`` moves to this checkpoint only once all of it is written,
    then only the newest ``keep`` complete checkpoints are kept (0: all). ``RunFailure`` on every rank when
    any rank fails to write its part."""
    return write_checkpoint(root, step, sharded.state_dict(), capture_rng_state(), meta, state, keep)


def write_checkpoint(root: str | os.PathLike, step: int, state_dict: dict[str, Any], rng: dict[str, Any],
                     meta: dict[str, Any], state: ParallelState, keep: int = 0,
                     group: dist.ProcessGroup | None = None) -> Path:
    """``save_checkpoint`` of a ``ShardedState.state_dict()`` (or its host copy) and this rank's RNG states
    ``rng``, every collective on ``group`` (default: the default group; ``async_save.py`` passes its own)."""
    root = Path(root)
    target = root / step_dir_name(step)
    previous = latest_name(root)

    def on_every_rank(work: Any) -> None:
        def check() -> None:
            try:
                work()
            except Exception as error:  # noqa: BLE001 - reported as a failed save naming the directory
                raise save_failure(error, target, previous) from None
        agree(check, group)

    def prepare() -> None:
        if state.rank == 0:
            if target.exists():  # left over from an interrupted save: never the one `latest` names
                shutil.rmtree(target)
            (target / "rng").mkdir(parents=True)

    writer = dcp.FileSystemWriter(target)
    writer.fs = hashing = HashingFileSystem()  # every shard's checksum, over the bytes as written
    digests: dict[str, tuple[int, str]] = {}

    def write_rng() -> None:
        name = f"rng/rank_{state.rank:05d}.pt"
        with open(target / name, "wb") as handle:
            torch.save(rng, handle)
        digests.update({name: file_digest(target / name), **hashing.digests})

    def publish() -> None:
        if state.rank == 0:
            text = json.dumps({**meta, "checksums": MANIFEST}, indent=2) + "\n"
            _atomic_write(target / META, text)
            files = {name: digest for part in every_rank for name, digest in part.items()}
            write_manifest(target, {**files, META: file_digest(target / META)})
            _atomic_write(root / LATEST, target.name + "\n")

    on_every_rank(prepare)
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=group)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        raise save_failure(error, target, previous) from None
    on_every_rank(write_rng)
    every_rank: list[dict[str, tuple[int, str]]] = [digests]
    if dist.get_world_size(group) > 1:
        every_rank = [{}] * dist.get_world_size(group)
        dist.all_gather_object(every_rank, digests, group=group)
    on_every_rank(publish)
    if state.rank == 0:
        prune(root, keep)
    dist.barrier(group=group)
    return target


def load_checkpoint(path: Path, meta: dict[str, Any], sharded: ShardedState, state: ParallelState
                    ) -> tuple[dict[str, Any] | None, str | None]:
    """Load the complete checkpoint ``path`` (its ``meta``) into model and optimizer, resharding to this layout.

    Returns ``(this rank's saved RNG states, note)``: the states when the layout is unchanged and every
    rank's RNG file is there; else None (the caller re-derives the RNG on every rank) and a note saying why.
    """
    target, reader = sharded.state_dict(), dcp.FileSystemReader(path)
    # a checkpoint from before gate and up were one weight loads into their blocks (``legacy.py``)
    to_load, split = loading_view(path, reader, sharded.model.config.ffn_hidden_size, target)
    try:
        dcp.load(to_load, storage_reader=reader)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        raise InputError(f"checkpoint {path} does not load into this model ({_root_message(error)}); "
                         f"resume with the model it was saved with") from None
    if split is not None:
        split.write_back()
        target["optimizer"]["param_groups"] = old_param_groups(to_load["optimizer"]["param_groups"])
    sharded.load_state_dict(target)
    saved = ParallelDims.from_layout(meta["layout"])
    if saved != state.dims:
        return None, f"layout changed from {saved} to {state.dims}: model and optimizer resharded"
    rng_file = path / "rng" / f"rank_{state.rank:05d}.pt"
    present = [rng_file.is_file()]
    if dist.get_world_size() > 1:
        present = [False] * dist.get_world_size()
        dist.all_gather_object(present, rng_file.is_file())
    missing = [str(path / "rng" / f"rank_{rank:05d}.pt") for rank, ok in enumerate(present) if not ok]
    if missing:
        return None, f"{', '.join(missing)} missing (RNG states of the checkpoint)"
    with open(rng_file, "rb") as handle:
        return torch.load(handle, weights_only=False), None
