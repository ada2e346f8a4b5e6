"""Checkpoints saved while the MLP's gate and up were two weights load into the fused ``mlp.gate_up``.

Such a checkpoint stores ``layers.i.mlp.gate.weight`` and ``layers.i.mlp.up.weight`` ``[ffn, hidden]`` (and their
AdamW state) where the model now has ``layers.i.mlp.gate_up.weight`` ``[2 * ffn, hidden]``, whose rows alternate
blocks of gate's and up's rows (``model/mlp.py``'s ``gate_up_pairs``). ``SplitGateUp`` gives DCP gate's and up's rows
of this rank's blocks as DTensors at the old names and shapes and copies what DCP loaded back into the blocks;
``stored_apart`` tells such a checkpoint by its metadata, ``loading_view`` gives the loaders (resume, evaluation)
what DCP loads into; ``old_param_groups`` renames the optimizer's parameter lists. The export reads the two tensors
and interleaves them (``cp_train/checkpoint/export_hf.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor, Shard

from cp_train.errors import InputError, agree
from cp_train.model.config import gate_up_block
from cp_train.model.mlp import gate_up_pairs
from cp_train.model.shards import chunk_start

FUSED = ".mlp.gate_up.weight"
PARTS = (".mlp.gate.weight", ".mlp.up.weight")


def old_names(name: str) -> tuple[str, str] | None:
    """The gate and up names a fused parameter ``name`` had (None for any other parameter)."""
    if not name.endswith(FUSED):
        return None
    stem = name.removesuffix(FUSED)
    return stem + PARTS[0], stem + PARTS[1]


def stored_apart(keys: Iterable[str]) -> bool:
    """Whether the checkpoint's state-dict ``keys`` (``model.<fqn>``, ...) hold gate and up apart."""
    return any(key.startswith("model.") and key.endswith(PARTS[0]) for key in keys)


class SplitGateUp:
    """A view of ``ShardedState.state_dict()`` for DCP to load a checkpoint that stores gate and up apart into:
    each fused DTensor (parameter and AdamW state) as copies of gate's and up's rows at the old names and shapes;
    ``write_back`` puts what DCP loaded into the fused tensors' blocks. ``path`` names the checkpoint in errors,
    ``block`` is the model's ``gate_up_block``."""

    def __init__(self, path: object, block: int) -> None:
        self.path, self.block = path, block
        self.pending: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []  # (fused local, (gate, up) copies)

    def view(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` (``{"model": ..., "optimizer": ...}``, or the model alone) with every fused entry at the old
        names (other entries, and non-tensors, shared)."""
        model: dict[str, Any] = {}
        for name, value in state_dict["model"].items():
            names = old_names(name)
            model.update({name: value} if names is None else dict(zip(names, self._halves(name, value), strict=True)))
        if "optimizer" not in state_dict:  # the model alone (evaluation)
            return {"model": model}
        state: dict[str, Any] = {}
        for fqn, entry in state_dict["optimizer"]["state"].items():
            names = old_names(fqn)
            if names is None:
                state[fqn] = entry
                continue
            split = {key: self._halves(fqn, value) if value.dim() else (value, value) for key, value in entry.items()}
            for index, old in enumerate(names):
                state[old] = {key: pair[index] for key, pair in split.items()}
        return {"model": model, "optimizer": {**state_dict["optimizer"], "state": state}}

    def _halves(self, name: str, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(value, DTensor):
            raise TypeError(f"{name}: ShardedState gives DTensors, got {type(value).__name__}")
        local, pair = value.to_local(), 2 * self.block
        if _row_start(value) % pair or local.shape[0] % pair:
            gate, up = old_names(name)  # type: ignore[misc]
            raise InputError(f"checkpoint {self.path} stores {gate} and {up} apart (saved before gate and up became "
                             f"one weight); it loads where every rank holds whole blocks of {pair} gate/up rows: "
                             f"resume with a data x context parallel size that divides ffn_hidden_size / {self.block}")
        halves = tuple(part.flatten(0, 1).clone() for part in gate_up_pairs(local, self.block))
        self.pending.append((local, halves))
        shape = (value.shape[0] // 2, *value.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return tuple(DTensor.from_local(half, value.device_mesh, value.placements, run_check=False, shape=shape,
                                        stride=stride) for half in halves)  # type: ignore[return-value]

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy every loaded half into its fused tensor's rows."""
        for local, halves in self.pending:
            for target, half in zip(gate_up_pairs(local, self.block), halves, strict=True):
                target.copy_(half.view_as(target))
        self.pending.clear()


def loading_view(path: object, reader: FileSystemReader, ffn: int, target: dict[str, Any]
                 ) -> tuple[dict[str, Any], SplitGateUp | None]:
    """What DCP loads into for ``target`` (a ``ShardedState.state_dict()``, or its model part) from the checkpoint
    ``reader`` reads: ``target`` itself, or for a checkpoint storing gate and up apart the ``SplitGateUp`` view (its
    check agreed on every rank) with the split to ``write_back`` after the load. ``ffn``: the model's MLP width."""
    if not stored_apart(reader.read_metadata().state_dict_metadata):
        return target, None
    split = SplitGateUp(path, gate_up_block(ffn))
    return agree(lambda: split.view(target)), split


def _row_start(value: DTensor) -> int:
    """The first full-tensor row of ``value``'s local shard: one mesh dim at most splits rows (``ShardedState``)."""
    mesh = value.device_mesh
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            return chunk_start(value.shape[0], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    return 0


def old_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loaded optimizer ``param_groups`` with each gate name renamed to its fused name and up's dropped."""
    out = []
    for group in groups:
        params = []
        for name in group["params"]:
            if name.endswith(PARTS[0]):
                params.append(name.removesuffix(PARTS[0]) + FUSED)
            elif not name.endswith(PARTS[1]):
                params.append(name)
        out.append({**group, "params": params})
    return out
