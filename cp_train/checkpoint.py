"""Sharded checkpoints with torch.distributed.checkpoint (DCP) that resume exactly and reshard.

Layout of a checkpoint directory ``ROOT``::

    ROOT/latest                   name of the newest COMPLETE checkpoint (written last, atomically)
    ROOT/step_00000100/.metadata  DCP: model and optimizer, one writer per shard
    ROOT/step_00000100/*.distcp
    ROOT/step_00000100/rng/rank_00003.pt   every rank's RNG states
    ROOT/step_00000100/meta.json  step, consumed_samples, scheduler, layout, config

Model and optimizer tensors are saved as DTensors on the ``("dp", "cp", "tp")`` mesh: TP-sharded
parameters (``partition_dim``) as ``Shard`` over ``tp``, everything else replicated, so DCP writes
each shard once and loads them into any other (tp, cp, dp) layout. A crash during a save leaves
``latest`` on the previous checkpoint; the partial directory is ignored (and replaced by the next save).
"""

from __future__ import annotations

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
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from cp_train.rng import capture_rng_state
from parallel.state import ParallelState

LATEST = "latest"
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint ``path`` names: ``path/latest``'s target, or ``path`` itself when it is one
    checkpoint; None when ``path`` holds none yet."""
    root = Path(path)
    if (root / META).is_file():
        return root
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    target = root / pointer.read_text().strip()
    if not (target / META).is_file():
        raise FileNotFoundError(f"{pointer} points at {target}, which is not a complete checkpoint")
    return target


class ShardedState:
    """Model and optimizer state as DTensors on ``state.mesh`` (the DCP view of this rank's shards)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState) -> None:
        self.model, self.optimizer, self.mesh = model, optimizer, state.mesh
        self.tp = state.tp.size
        self.placements: dict[str, int | None] = {  # parameter -> its TP partition dim (None: replicated)
            name: param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            for name, param in model.named_parameters()}

    def _wrap(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        dim = self.placements.get(name)
        if tensor.dim() == 0 or name not in self.placements:
            return tensor  # optimizer step counts: replicated plain tensors
        shape = list(tensor.shape)
        placement = Replicate()
        if dim is not None:
            shape[dim] *= self.tp
            placement = Shard(dim)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(tensor, self.mesh, [Replicate(), Replicate(), placement], run_check=False,
                                  shape=torch.Size(shape), stride=stride)

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

    def load_state_dict(self, loaded: dict[str, Any]) -> None:
        """Copy a DCP-loaded ``state_dict()`` back into the model and the optimizer."""
        def local(value: Any) -> Any:
            return value.to_local() if isinstance(value, DTensor) else value
        set_model_state_dict(self.model, {k: local(v) for k, v in loaded["model"].items()})
        optim = loaded["optimizer"]
        set_optimizer_state_dict(self.model, self.optimizer, {
            "state": {fqn: {k: local(v) for k, v in entry.items()} for fqn, entry in optim["state"].items()},
            "param_groups": optim["param_groups"]})


def save_checkpoint(root: str | os.PathLike, step: int, sharded: ShardedState, meta: dict[str, Any],
                    state: ParallelState) -> Path:
    """Save on every rank (collective); ``latest`` moves to this checkpoint only once all of it is written."""
    root = Path(root)
    target = root / step_dir_name(step)
    if state.rank == 0:
        if target.exists():  # left over from an interrupted save: never the one `latest` names
            shutil.rmtree(target)
        (target / "rng").mkdir(parents=True)
    dist.barrier()
    dcp.save(sharded.state_dict(), storage_writer=dcp.FileSystemWriter(target))
    torch.save(capture_rng_state(), target / "rng" / f"rank_{state.rank:05d}.pt")
    dist.barrier()
    if state.rank == 0:
        _atomic_write(target / META, json.dumps(meta, indent=2) + "\n")
        _atomic_write(root / LATEST, target.name + "\n")
    dist.barrier()
    return target


def load_checkpoint(path: Path, sharded: ShardedState, state: ParallelState) -> dict[str, Any]:
    """Load ``path`` (a complete checkpoint) into model and optimizer, resharding to this layout; return
    its meta with ``"rng_state"`` set to this rank's saved RNG states when the layout is unchanged."""
    meta = json.loads((path / META).read_text())
    target = sharded.state_dict()
    dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    sharded.load_state_dict(target)
    saved = meta["layout"]
    same = (saved["tp"], saved["cp"], saved["dp"]) == state.sizes
    rng_file = path / "rng" / f"rank_{state.rank:05d}.pt"
    meta["rng_state"] = torch.load(rng_file, weights_only=False) if same and rng_file.is_file() else None
    return meta
