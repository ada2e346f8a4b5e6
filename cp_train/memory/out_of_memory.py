"""A device that runs out of memory mid-run, said in one line with what to change: torch's own first words, the
peak, and the dry run of the run's config (``dry_run_report.py``: the largest rank's plan against the device's
usable memory, and its ``to fit`` hint)."""

from __future__ import annotations

import traceback

import torch

from cp_train.config.schema import Config
from cp_train.errors import RunFailure, one_line
from cp_train.memory.dry_run import reserve_gib, sig3
from cp_train.memory.dry_run_report import report
from cp_train.metrics.throughput import device_memory_gib, peak_memory_gib
from cp_train.parallel.mesh.state import ParallelState

# where in the training loop, by the project's module the error passed through after the step (the first found)
PHASES = (("runtime/validation.py", "in the validation after step {step}"),
          ("eval/", "in the long-context eval after step {step}"),
          ("checkpoint/", "saving the checkpoint of step {step}"))


def where_in_run(error: BaseException, step: int) -> str:
    """Where in the training loop ``error`` was raised, ``step`` steps done: ``in step {step + 1}``, or the
    validation, the long-context eval or the checkpoint's save after step ``step`` (from its traceback)."""
    for frame in traceback.extract_tb(error.__traceback__):
        path = frame.filename.replace("\\", "/")
        for module, phase in PHASES:
            if f"/cp_train/{module}" in path or path.startswith(f"cp_train/{module}"):
                return phase.format(step=step)
    return f"in step {step + 1}"


class OutOfDeviceMemory(RunFailure):
    """The device ran out of memory (exit code 1) on the ranks that raise it, each of which says so."""

    everywhere = False


def out_of_memory(config: Config, state: ParallelState, where: str, device: torch.device,
                  error: BaseException) -> OutOfDeviceMemory:
    """The error to raise in place of torch's ``OutOfMemoryError`` ``error`` on this rank of ``state``; ``where``:
    ``in step 3``, ``building the model``."""
    world, rank = state.world_size, state.rank
    said = ". ".join(one_line(str(error)).split(". ")[:2]).rstrip(".")  # "CUDA out of memory. Tried to allocate .."
    line = (f"the {device.type} device ran out of memory on rank {rank} {where} ({said}; peak "
            f"{peak_memory_gib(device):.1f} GiB allocated)")
    try:
        total = device_memory_gib(device) or 80.0
        plan = report(config, world, total, reserve_gib=reserve_gib(total))
    except Exception as planning:  # noqa: BLE001 - the plan helps; it never hides the error itself
        return OutOfDeviceMemory(f"{line}; the dry run could not plan this config ({one_line(str(planning))})")
    verdict = ("" if plan.largest_gib > plan.usable_gib else
               ", within it: the dry run underestimates this run, or the reserve (--reserve-gib) is too small")
    return OutOfDeviceMemory(f"{line}: the dry run plans {sig3(plan.largest_gib)} GiB for the largest rank of "
                             f"{sig3(plan.usable_gib)} GiB usable{verdict}; to fit: {plan.hint} (plan a change with "
                             f"python train.py ... --dry-run)")
