"""Rank-side runs for the checkpoints written behind training (``checkpoint.async_save``; spawned gloo worlds)."""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed.checkpoint as dcp

from cp_train.checkpoint.files import step_dir_name
from cp_train.parallel.mesh.state import ParallelState
from cp_train.trainer import Trainer
from tests.trainer_cases import full_state, tiny_config


def train_with_patched_writes(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any],
                              until_step: int, write: Any, want: tuple[str, ...] = (),
                              grad_callback: Any = None) -> dict[str, Any]:
    """Train with ``write(step saved, go on)`` called as each checkpoint's shards are written (``go on`` writes
    them) and the trainer's ``grad_callback``. Returns the losses, the messages, the error the run stopped with
    ("" if none), its last step and rank 0's full ``want`` states at the end."""
    writer, trainer = dcp.FileSystemWriter, Trainer(tiny_config(prefix, run_dir, state.dims, **overrides), state)
    original, trainer.grad_callback = writer.write_data, grad_callback

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        step = int(str(self.path).rsplit("_", 1)[1])
        return write(step, lambda: original(self, plan, planner))

    writer.write_data = write_data  # type: ignore[method-assign]
    error = ""
    try:
        trainer.train(until_step)
    except BaseException as raised:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        error = f"{type(raised).__name__}: {raised}"
    finally:
        writer.write_data = original  # type: ignore[method-assign]
    return {"losses": trainer.result.losses, "messages": trainer.result.messages, "error": error,
            "step": trainer.step, "end": {w: full_state(trainer, w) for w in want} if state.rank == 0 else {}}


def written_behind(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any], until_step: int,
                   want: tuple[str, ...]) -> dict[str, Any]:
    """Step 2's checkpoint write waits (20 s at most) until step ``until_step``'s gradients exist, so the steps
    between update the parameters while it is written; a save in the step would wait for itself. ``behind``:
    whether they did."""
    later = threading.Event()
    behind: dict[int, bool] = {}

    def write(step: int, go_on: Any) -> Any:
        if step == 2:
            behind[step] = later.wait(timeout=20)
        return go_on()

    out = train_with_patched_writes(state, prefix, run_dir, overrides, until_step, write, want,
                                    lambda done: later.set() if done == until_step else None)
    return {**out, "behind": behind.get(2)}


def failing_behind(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any], fail_step: int,
                   failing_rank: int) -> dict[str, Any]:
    """Rank ``failing_rank`` fails to write its shards of step ``fail_step``'s checkpoint, behind training."""
    def write(step: int, go_on: Any) -> Any:
        if step == fail_step and state.rank == failing_rank:
            raise OSError(f"simulated failure of rank {state.rank} writing {step_dir_name(step)}")
        return go_on()

    return train_with_patched_writes(state, prefix, run_dir, overrides, 0, write)


def failing_beside_the_run(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any],
                           fail_step: int) -> dict[str, Any]:
    """Rank 1 fails to write step ``fail_step``'s checkpoint behind training, and the next step fails on every
    rank for a reason of its own (the run's error)."""
    def write(step: int, go_on: Any) -> Any:
        if step == fail_step and state.rank == 1:
            raise OSError(f"simulated failure of rank {state.rank} writing {step_dir_name(step)}")
        return go_on()

    def fail_next_step(done: int) -> None:
        if done == fail_step + 1:
            raise RuntimeError(f"simulated failure of step {done}")

    return train_with_patched_writes(state, prefix, run_dir, overrides, 0, write, grad_callback=fail_next_step)
