"""Checkpoints written behind training (``checkpoint.async_save``), or in the step (the default).

With ``async_save`` a save step waits only while every rank copies its model and optimizer state (DCP's view,
``ShardedState.state_dict``) and its RNG states to host memory: page-locked on CUDA, and the buffers are kept
for the next save (one copy of the rank's state in host memory for the run). DCP's write, the RNG files, the
manifest, ``latest`` and the pruning of old checkpoints (``dcp.write_checkpoint``) then run on a background
thread while training goes on. That thread's collectives (DCP's planning, the checksums' gather, the error
agreement) run on a gloo group of their own that every rank creates at the start, never on the training's
communicators, whose order NCCL requires every rank to keep.

At most one save is in flight: the next save, the end of the run and a preemption's stop wait for it, and a
write that failed raises there the ``RunFailure`` a save in the step raises (``latest`` still names the previous
checkpoint). The copy is taken after the step's update, so the checkpoint is exactly the one a save in the step
writes.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import StateDictStager

from cp_train.checkpoint.dcp import ShardedState, save_checkpoint, write_checkpoint
from cp_train.checkpoint.rng import capture_rng_state
from cp_train.parallel.mesh.open_files import gloo_group_of_every_rank
from cp_train.parallel.mesh.state import ParallelState

if TYPE_CHECKING:
    from cp_train.config.schema import CheckpointConfig


class CheckpointSaver:
    """Saves checkpoints for one run on every rank (construction and every call are collective)."""

    def __init__(self, state: ParallelState, background: bool, timeout: timedelta) -> None:
        self.state, self.background = state, background
        self.group: dist.ProcessGroup | None = None
        self.stager: StateDictStager | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.pending: Future | None = None
        self.waited_s = 0.0  # how long the step waited for the host copy of the save in flight
        if background and dist.is_initialized():
            self.group = gloo_group_of_every_rank(timeout)

    def save(self, root: str | os.PathLike, step: int, sharded: ShardedState, meta: dict[str, Any],
             keep: int = 0) -> list[str]:
        """Save the state at ``step``; returns a line for each checkpoint complete by now (this one in the step;
        with ``background``, the one written behind the steps before it, if any)."""
        if not self.background:
            return [f"saved checkpoint {save_checkpoint(root, step, sharded, meta, self.state, keep)}"]
        done = self.wait()
        if self.executor is None:  # made at the first save (again after ``close``)
            self.stager = StateDictStager(pin_memory=torch.cuda.is_available(), share_memory=False)
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        started = time.perf_counter()
        staged = self.stager.stage(sharded.state_dict())  # type: ignore[union-attr]  # blocking copies
        rng, self.waited_s = capture_rng_state(), time.perf_counter() - started
        self.pending = self.executor.submit(self._write, root, step, staged, rng, meta, keep)  # type: ignore[union-attr]
        return done

    def _write(self, root: str | os.PathLike, step: int, staged: dict[str, Any], rng: dict[str, Any],
               meta: dict[str, Any], keep: int) -> str:
        started = time.perf_counter()
        path = write_checkpoint(root, step, staged, rng, meta, self.state, keep, self.group)
        return (f"saved checkpoint {path} (written behind training in {time.perf_counter() - started:.1f} s; "
                f"the step waited {self.waited_s:.2f} s for the copy to host memory)")

    def wait(self) -> list[str]:
        """Wait for the save in flight (none: nothing to wait for); its line, or the ``RunFailure`` it raised."""
        pending, self.pending = self.pending, None
        return [] if pending is None else [pending.result()]

    def close(self) -> list[str]:
        """Wait for the save in flight, then stop the thread and free the host copy (a later save makes them
        again)."""
        try:
            return self.wait()
        finally:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
                self.stager.close()  # type: ignore[union-attr]
                self.executor = self.stager = None


def saver_for(state: ParallelState, checkpoint: CheckpointConfig, timeout_minutes: float) -> CheckpointSaver:
    """The run's saver: in the background with ``checkpoint.async_save`` and a ``checkpoint.save`` directory."""
    return CheckpointSaver(state, bool(checkpoint.async_save and checkpoint.save), timedelta(minutes=timeout_minutes))

