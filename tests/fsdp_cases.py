"""Rank-side checks of the data-parallel wrappers (``parallel/dp/ddp.py``, ``model/parallelize.py``) on the tiny
trainer run.

Called as ``run_with_parallel((tp, cp, dp), fn, ...)`` on every rank of a spawned gloo world.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from cp_train.parallel.compat import ALL_GATHER_NAME, REDUCE_SCATTER_NAME
from cp_train.parallel.cp.op import handle_contents
from cp_train.parallel.dp import ddp as data_parallel
from cp_train.parallel.mesh.state import ParallelState
from cp_train.trainer import Trainer
from tests.trainer_cases import GLOBAL_BATCH, tiny_config

# FSDP2's collectives, counted by their torch 2.13 names: torch.distributed's names for them in this torch
COUNTED = {"reduce_scatter_single": REDUCE_SCATTER_NAME, "all_gather_single": ALL_GATHER_NAME}


@contextmanager
def counting(counts: Counter, group: dist.ProcessGroup) -> Iterator[None]:
    """Count FSDP2's reduce-scatters and all-gathers on ``group`` (DP x CP; the CP plans gather on the
    CP group) and DDP's gradient all-reduces (its comm hook) in ``counts``."""
    originals: dict[str, Callable[..., Any]] = {name: getattr(dist, attribute) for name, attribute in COUNTED.items()}
    hook = data_parallel._sum_all_reduce

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is group:
                counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, COUNTED[name], wrap(name, fn))
    def counted_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the hook's parameter names
        counts["ddp_all_reduce"] += 1
        return hook(state, bucket)

    data_parallel._sum_all_reduce = counted_hook
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, COUNTED[name], fn)
        data_parallel._sum_all_reduce = hook


def collectives_per_step(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any]
                         ) -> dict[int, dict[str, int]]:
    """Per number of micro-batches per rank (GLOBAL_BATCH and 1): the gradient reductions and gathers issued in
    one training step (the second; DDP settles its buckets in the first) under ``overrides``."""
    out = {}
    for micro in (1, GLOBAL_BATCH):
        counts: Counter = Counter()
        with counting(counts, state.dp_cp.group):  # DDP registers its comm hook when it is built
            trainer = Trainer(tiny_config(prefix, f"{run_dir}/micro{micro}", state.dims,
                                          **{"train.micro_batch_size": micro, **overrides}), state)
            batches = iter(trainer.loader)
            trainer.train_step(next(batches))
            counts.clear()
            trainer.train_step(next(batches))
        out[GLOBAL_BATCH // micro] = dict(counts)
    return out


def bf16_step(state: ParallelState, prefix: str, run_dir: str) -> dict[str, Any]:
    """One FSDP step in bf16 (the mixed-precision policy): the dtypes the first block computes with, of the
    stored parameters and of their gradients, and the step-1 loss."""
    trainer = Trainer(tiny_config(prefix, run_dir, state.dims, **{"parallel.fsdp": True, "train.dtype": "bf16"}),
                      state)
    seen: list[torch.dtype] = []
    qkv = trainer.model.layers[0].attention.qkv
    handles = [qkv.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))]
    given, plans = [], []  # the plan the model is given, and what each block receives (casting would copy it)
    handles += [trainer.model.register_forward_pre_hook(lambda module, args, kwargs: given.append(kwargs["plan"]),
                                                        with_kwargs=True)]
    handles += [layer.register_forward_pre_hook(lambda module, args: plans.append(handle_contents(args[1].handle)[2]))
                for layer in trainer.model.layers]
    result = trainer.train_step(next(iter(trainer.loader)))
    for handle in handles:
        handle.remove()
    params = list(trainer.model.parameters())
    return {"compute": seen[0], "stored": {p.dtype for p in params}, "grads": {p.grad.dtype for p in params},
            "loss": result.loss, "plan_type": type(given[0]).__name__, "blocks_run": len(plans),
            "expected_blocks": len(given) * len(trainer.model.layers),
            "foreign_plans": len({id(plan) for plan in plans} - {id(plan) for plan in given})}


def reduce_scatters_overlap(state: ParallelState, prefix: str, run_dir: str) -> dict[str, Any]:
    """FSDP on CPU: how FSDP2's reduce-scatters were issued (asynchronously or not) in one step and in a further
    backward onto the gradients already there (FSDP2 adds into them at once: those must reduce in place), how
    many were in flight when the step's backward returned, and whether both gradients equal those of FSDP2's
    own synchronous reduce-scatter bitwise."""
    grads: dict[bool, list[torch.Tensor]] = {}
    issued: Counter = Counter()
    original = getattr(dist, REDUCE_SCATTER_NAME)

    def traced(*args: Any, **kwargs: Any) -> Any:
        issued["async" if kwargs.get("async_op") else "sync"] += 1
        return original(*args, **kwargs)

    result: dict[str, Any] = {}
    for overlapped in (True, False):
        trainer = Trainer(tiny_config(prefix, f"{run_dir}/{overlapped}", state.dims, **{"parallel.fsdp": True}), state)
        comm = trainer.module._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
        if not overlapped:
            for module in trainer.module.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_reduce_scatter(DefaultReduceScatter())
        micro_batches = trainer._to_device(next(iter(trainer.loader)))
        setattr(dist, REDUCE_SCATTER_NAME, traced)
        try:
            trainer.forward_backward(micro_batches)
            if overlapped:
                result.update(comm=type(comm).__name__, in_flight=len(comm.pending), step=dict(issued))
                issued.clear()
            grads[overlapped] = [p.grad.full_tensor() for p in trainer.model.parameters()]
            with data_parallel.gradient_sync(trainer.module, True):
                token_losses, _ = trainer._losses(micro_batches[0])
                token_losses.sum().backward()
            if overlapped:
                result["onto_grads"] = dict(issued)
        finally:
            setattr(dist, REDUCE_SCATTER_NAME, original)
        grads[overlapped] += [p.grad.full_tensor() for p in trainer.model.parameters()]
    result["exact"] = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
    return result
