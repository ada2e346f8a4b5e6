"""``parallel.fsdp_reduce: auto`` resolved on the dry run's plans, the same way by the dry run and the trainer:
per_step (one reduce-scatter per step) when that plan fits the device inside the reserve, else per_microbatch (no
unsharded gradients kept between micro-batches)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from cp_train.config.schema import Config
from cp_train.config.validate import validate
from cp_train.memory.dry_run import GIB, memory_plan, reserve_gib, sig3


def resolve_fsdp_reduce(config: Config, world: int, device_gib: float | None, reserve: float = 0.0
                        ) -> tuple[str, str]:
    """``parallel.fsdp_reduce`` and why, with ``auto`` resolved: per_step (one reduce-scatter per step) when the
    plan with it fits ``device_gib`` less ``reserve`` (or nothing accumulates, or there is no FSDP or no device
    limit: CPU), else per_microbatch (no unsharded gradients kept between micro-batches)."""
    parallel, train = config.parallel, config.train
    if parallel.fsdp_reduce != "auto":
        return parallel.fsdp_reduce, "set in the config"
    if not parallel.fsdp:
        return "per_step", "no FSDP: DDP reduces once per step"
    dp = validate(config, world)
    if train.global_batch_size == train.micro_batch_size * dp:
        return "per_step", "one micro-batch per step: nothing accumulates"
    if parallel.backend == "gloo" or device_gib is None:
        return "per_step", "on CPU: no device memory to fit"
    usable = device_gib - reserve
    needs = {mode: max(r.total_bytes for r in memory_plan(with_reduce(config, mode), world, only=[0])[1]) / GIB
             for mode in ("per_step", "per_microbatch")}
    if needs["per_step"] <= usable:
        return "per_step", (f"fits: {sig3(needs['per_step'])} of {sig3(usable)} GiB usable; per_microbatch would "
                            f"need {sig3(needs['per_microbatch'])} GiB and reduce-scatter every micro-batch")
    return "per_microbatch", (f"per_step needs {sig3(needs['per_step'])} GiB of {sig3(usable)} usable, "
                              f"per_microbatch {sig3(needs['per_microbatch'])}")


def with_reduce(config: Config, mode: str) -> Config:
    return replace(config, parallel=replace(config.parallel, fsdp_reduce=mode))


def fsdp_reduce_for_run(config: Config, world: int, device: torch.device) -> tuple[str, str]:
    """``resolve_fsdp_reduce`` for a run on ``device``: on CUDA against the device's total memory less the
    default reserve (every rank's choice gathered: per_microbatch if any rank needs it), else without a limit."""
    if config.parallel.fsdp_reduce != "auto" or device.type != "cuda":
        return resolve_fsdp_reduce(config, world, None)
    device_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    choice = resolve_fsdp_reduce(config, world, device_gib, reserve_gib(device_gib))
    if dist.is_initialized() and dist.get_world_size() > 1:
        choices: list[tuple[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(choices, choice)
        choice = max(choices, key=lambda c: c is not None and c[0] == "per_microbatch")  # type: ignore[assignment]
    return choice  # type: ignore[return-value]
