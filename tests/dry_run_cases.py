"""Rank-side measurements for ``test_dry_run_memory.py`` (spawned gloo worlds, the tiny trainer run)."""

from __future__ import annotations

import torch

from cp_train.config.schema import Config
from cp_train.parallel.mesh.state import ParallelState
from cp_train.trainer import Trainer


def block_input_bytes(state: ParallelState, config: Config) -> list[int]:
    """The bytes of each block's input (its storage: what a checkpointed block keeps) in one training step."""
    trainer = Trainer(config, state)
    seen: list[int] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen.append(args[0].untyped_storage().nbytes())

    handles = [layer.register_forward_pre_hook(record) for layer in trainer.model.layers]
    try:
        trainer.train_step(next(iter(trainer.loader)))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def collective_output_bytes(state: ParallelState) -> dict[str, int]:
    """Bytes ``LiveTensorBytes`` counts for gloo collectives' outputs beyond their input (1 MiB / world): the
    functional all-gather's, allocated inside its op (1 MiB), and an all-to-all's, allocated by the caller."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from bench.tensor_bytes import LiveTensorBytes
    from cp_train.parallel.compat import functional_all_gather

    world = dist.get_world_size()
    x = torch.ones(2**18 // world)  # 1 MiB / world
    out: dict[str, int] = {}
    for name in ("all_gather", "all_to_all"):
        tracker = LiveTensorBytes()
        tracker.track([x])
        with tracker:
            if name == "all_gather":
                kept = funcol.wait_tensor(functional_all_gather(x, 0, dist.group.WORLD))
            else:
                kept = torch.empty(2**18 // world)
                dist.all_to_all_single(kept, x)
        out[name] = tracker.current - x.untyped_storage().nbytes()
        del kept
    return out
