"""Rank side of the in-run CP check's tests (``train.check_cp_every``): the tiny run of ``trainer_cases`` with
communication faults injected below the project, as a broken network or NCCL would make them:

- ``ring``: every ring message arrives as zeros (``RingComm``'s transfers, forward and backward);
- ``all_to_all``: every Ulysses all-to-all delivers zeros;
- ``replica``: one rank's copy of one weight changed by its lowest bit after an update (``train.check_replicas_every``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cp_train.errors import RunFailure
from cp_train.metrics.writers import METRICS_FILE
from cp_train.model.shards import local_tensor
from cp_train.parallel.cp.ring import comm
from cp_train.parallel.mesh.state import ParallelState
from cp_train.trainer import Trainer
from tests.trainer_cases import tiny_config


def _lost_ring_messages() -> tuple[Any, str, Any]:
    original = comm.Transfer.wait

    def wait(self: comm.Transfer) -> list[torch.Tensor]:
        return [torch.zeros_like(t) for t in original(self)]
    return comm.Transfer, "wait", wait


class _ZeroedOnWait:
    """A collective's work whose output reads as zeros once waited for."""

    def __init__(self, work: Any, output: torch.Tensor) -> None:
        self.work, self.output = work, output

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        self.output.zero_()
        return done


def _zeroed_all_to_all() -> tuple[Any, str, Any]:
    original = dist.all_to_all_single

    def all_to_all_single(output: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = original(output, *args, async_op=async_op, **kwargs)
        if not async_op:
            output.zero_()
            return work
        return _ZeroedOnWait(work, output)
    return dist, "all_to_all_single", all_to_all_single


CORRUPTED = "layers.1.mlp.down.weight"  # the tensor ``_corrupt_a_replica`` changes


def _corrupt_a_replica(trainer: Trainer, rank: int = 3, step: int = 2) -> None:
    """On global rank ``rank``, flip the lowest bit of one element of ``CORRUPTED`` after the update of step
    ``step``: its replicas differ by the least a bit can change."""
    if dist.get_rank() != rank:
        return
    step_fn, param = trainer.optimizer.step, dict(trainer.model.named_parameters())[CORRUPTED]

    def corrupting_step(*args: Any, **kwargs: Any) -> Any:
        result = step_fn(*args, **kwargs)
        if trainer.step + 1 == step:  # the trainer counts the step after its update
            bits = local_tensor(param).view(torch.int32).reshape(-1)
            bits[5] = bits[5] ^ 1
        return result

    trainer.optimizer.step = corrupting_step  # type: ignore[method-assign]


FAULTS = {"ring": _lost_ring_messages, "all_to_all": _zeroed_all_to_all}


def train_checked(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any],
                  fault: str | None = None) -> dict[str, Any]:
    """Train the tiny run with ``overrides`` and ``fault`` (``FAULTS``; None: none). Returns the losses, the
    ``cp_check_rel_err`` of every logged step that has one (rank 0) and the CP check's line if it stopped the run."""
    patched = None
    if fault in FAULTS:
        owner, name, replacement = FAULTS[fault]()
        patched = owner, name, getattr(owner, name)
        setattr(owner, name, replacement)
    trainer = Trainer(tiny_config(prefix, run_dir, state.dims, **overrides), state)
    if fault == "replica":
        _corrupt_a_replica(trainer)
    out: dict[str, Any] = {"failure": None}
    try:
        out["losses"] = trainer.train().losses
    except RunFailure as failure:
        out["failure"], out["losses"] = str(failure), trainer.result.losses
    finally:
        if patched is not None:
            setattr(*patched)
    metrics = Path(run_dir) / METRICS_FILE
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if state.rank == 0 else []
    out["checks"] = {r["step"]: r["cp_check_rel_err"] for r in records if "cp_check_rel_err" in r}
    out["messages"] = trainer.result.messages
    return out
