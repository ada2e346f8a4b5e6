"""A checkpoint as cp-train wrote it while the MLP's gate and up were two weights, made from a current one.

``with_gate_and_up_apart(step_dir, root)`` rewrites the checkpoint ``step_dir`` into ``root`` (``root/latest`` and
the step directory): every ``layers.i.mlp.gate_up.weight`` (and its AdamW state) becomes ``mlp.gate.weight`` and
``mlp.up.weight``, its alternating blocks of rows; meta.json and the RNG files are copied and the manifest rewritten.
``evaluated_weights`` (a rank function): the parameters ``cp_train.eval`` loads from a checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from cp_train.checkpoint.files import LATEST, META
from cp_train.checkpoint.integrity import MANIFEST, file_digest, write_manifest
from cp_train.checkpoint.legacy import old_names
from cp_train.eval.load import eval_config, load_model
from cp_train.model.config import gate_up_block
from cp_train.model.mlp import split_gate_up
from cp_train.parallel.mesh.state import ParallelState


def _apart(entries: dict[str, Any], split: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in entries.items():
        names = old_names(name)
        out.update({name: value} if names is None else dict(zip(names, split(value), strict=True)))
    return out


def with_gate_and_up_apart(step_dir: Path, root: Path, ffn: int) -> Path:
    """Write ``step_dir``'s checkpoint (of a model of MLP width ``ffn``) with gate and up apart as ``root/<the same
    step directory name>``."""
    work = root / "work"
    work.mkdir(parents=True)
    dcp_to_torch_save(step_dir, work / "fused.pt")
    state = torch.load(work / "fused.pt", weights_only=False)
    halves = lambda t: split_gate_up(t, gate_up_block(ffn))  # noqa: E731
    state["model"] = _apart(state["model"], halves)
    state["optimizer"]["state"] = _apart(state["optimizer"]["state"], lambda entry: tuple(
        {key: (halves(value)[index] if value.dim() else value.clone()) for key, value in entry.items()}
        for index in range(2)))
    for group in state["optimizer"]["param_groups"]:
        group["params"] = [old for name in group["params"] for old in (old_names(name) or (name,))]
    torch.save(state, work / "apart.pt")
    target = root / step_dir.name
    torch_save_to_dcp(work / "apart.pt", target)
    shutil.rmtree(work)
    shutil.copy(step_dir / META, target / META)
    shutil.copytree(step_dir / "rng", target / "rng")
    files = [path for path in target.rglob("*") if path.is_file() and path.name != MANIFEST]
    write_manifest(target, {str(path.relative_to(target)): file_digest(path) for path in files})
    (root / LATEST).write_text(step_dir.name + "\n")
    return target


def evaluated_weights(state: ParallelState, load: str) -> dict[str, torch.Tensor]:
    """Rank 0's parameters of the model ``cp_train.eval`` loads from checkpoint ``load`` (at tp 1, whole tensors;
    other ranks return nothing)."""
    model = load_model(eval_config(load, None, {}, []), state, load, torch.device("cpu"))
    return {name: param.detach().clone() for name, param in model.named_parameters()} if state.rank == 0 else {}
