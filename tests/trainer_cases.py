"""Rank-side trainer runs for the layout-equivalence and checkpoint tests (spawned gloo worlds).

Every function is called as ``run_with_parallel((tp, cp, dp), fn, ...)`` on every rank of a
world of ``tp*cp*dp`` ranks. The data is a small synthetic corpus (``write_corpus``, test side)
of learnable documents of random lengths, each ending with EOD, with the EOD inputs masked out
of the loss, so CP ranks hold unequal numbers of loss tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from cp_train import build
from cp_train import trainer as trainer_module
from cp_train.config.schema import Config
from cp_train.config.sources import build_config
from cp_train.data.indexed import IndexedDatasetWriter
from cp_train.metrics.writers import METRICS_FILE
from cp_train.parallel.mesh.state import ParallelDims, ParallelState
from cp_train.results import NonFiniteLossError
from cp_train.trainer import Trainer

EOD, VOCAB = 2, 128
TINY_MODEL = {"vocab_size": VOCAB, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 64, "max_position_embeddings": 64, "seed": 7}
SEQ_LEN, GLOBAL_BATCH, STEPS = 32, 4, 20
# The loss-curve runs (equivalence, sequence parallel, compile): past the warm-up (2 steps), clipping on most steps
# (the tiny run's gradient norms are 0.80-0.94), evaluations at steps 3 and 6
CURVE_STEPS, CURVE_EVALS = 6, (3, 6)
CURVE = {"train.steps": CURVE_STEPS, "schedule.warmup_steps": 2, "train.valid_interval": 3,
         "optimizer.clip_grad": 0.85, "optimizer.lr": 6e-3}


def write_corpus(prefix: Path, num_docs: int = 600, seed: int = 0) -> str:
    """Documents that are an arithmetic progression of ids in [4, VOCAB) of 1..16 tokens plus EOD, or (40%)
    just EOD: runs of masked EOD inputs make the loss-token counts of CP ranks differ."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(num_docs):
            length = 0 if rng.random() < 0.4 else int(rng.integers(1, 17))
            start, stride = int(rng.integers(0, VOCAB - 4)), int(rng.integers(1, 6))
            body = 4 + (start + stride * np.arange(length)) % (VOCAB - 4)
            writer.add_document(np.append(body, EOD))
    return str(prefix)


def tiny_config(prefix: str, run_dir: str, dims: ParallelDims, **overrides: Any) -> Config:
    """The tiny fp32 run on ``prefix`` at layout ``dims``; ``overrides`` are dotted keys."""
    tp, cp, dp = dims.tp, dims.cp, dims.dp
    values = {f"model.{k}": v for k, v in TINY_MODEL.items()}
    values.update({
        "parallel.tp": tp, "parallel.cp": cp, "parallel.dp": dp, "data.prefix": prefix, "data.eod_id": EOD,
        "data.seq_len": SEQ_LEN, "data.valid_fraction": 0.1, "data.cache_dir": f"{run_dir}/index-cache",
        "train.steps": STEPS, "train.micro_batch_size": 2, "train.global_batch_size": GLOBAL_BATCH,
        "train.dtype": "fp32", "train.grad_bucket_mb": 0.01, "optimizer.lr": 3e-3, "optimizer.min_lr": 3e-4,
        "schedule.warmup_steps": 3, "train.valid_interval": 10, "logging.dir": run_dir, "logging.interval": 1,
        "logging.wandb": False, "logging.console": False})
    values.update(overrides)
    return build_config([("test", values)])


def _gather_tp(tensor: torch.Tensor, param: torch.nn.Parameter, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor of ``param`` (or of its gradient or Adam moment ``tensor``): FSDP shards gathered over
    DP x CP, then TP shards over ``group``."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def full_state(trainer: Trainer, what: str) -> dict[str, torch.Tensor]:
    """Full-shape gradients (``what="grads"``), parameters (``"params"``) or Adam moments (``"optimizer"``)."""
    group, out = trainer.state.tp.group, {}
    for name, param in trainer.model.named_parameters():
        if what == "grads":
            out[name] = _gather_tp(param.grad, param, group)
        elif what == "params":
            out[name] = _gather_tp(param, param, group)
        elif param in trainer.optimizer.state:  # a fresh optimizer has no state yet
            entry = trainer.optimizer.state[param]
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = _gather_tp(entry[key], param, group)
            out[f"{name}.step"] = entry["step"].detach().clone()
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        hasher.update(name.encode())
        hasher.update(tensors[name].contiguous().numpy().tobytes())
    return hasher.hexdigest()


def train_layout(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any] | None = None,
                 until_step: int | None = None, want: tuple[str, ...] = (), build_on_meta: bool = True
                 ) -> dict[str, Any]:
    """Train the tiny run on this layout. Returns the per-step losses, gradient norms and eval losses, a
    digest of each step's input tokens (this rank's), every rank's loss tokens in its first step, a digest
    of the first step's full gradients (equal on every rank), rank 0's first-step full gradients, rank
    0's full ``want`` states ("params", "optimizer") at the start (after any resume) and at the end, and the
    run's setup record (``metrics.jsonl``). ``build_on_meta`` False builds the full model first."""
    build.BUILD_ON_META = build_on_meta
    try:
        trainer = Trainer(tiny_config(prefix, run_dir, state.dims, **(overrides or {})), state)
    finally:
        build.BUILD_ON_META = True
    out: dict[str, Any] = {"start": {w: full_state(trainer, w) for w in want},
                           "consumed_at_start": trainer.loader.consumed_samples, "step_at_start": trainer.step}
    first: list[Any] = []
    batches: dict[int, str] = {}  # step -> digest of this rank's input tokens
    forward_backward = trainer.forward_backward

    def recording_forward_backward(micro_batches: list[dict[str, torch.Tensor]]) -> Any:
        batches[trainer.step + 1] = hashlib.sha256(b"".join(mb["tokens"].numpy().tobytes()
                                                            for mb in micro_batches)).hexdigest()
        result = forward_backward(micro_batches)
        if not first:
            first.append(result)
        return result

    def on_gradients(step: int) -> None:
        if "grads" not in out:  # the first step of this run
            grads = full_state(trainer, "grads")
            out["grads"], out["grad_digest"] = grads, digest(grads)

    trainer.forward_backward = recording_forward_backward  # type: ignore[method-assign]
    trainer.grad_callback = on_gradients
    result = trainer.train(until_step)
    out.update({"losses": result.losses, "grad_norms": result.grad_norms, "eval_losses": result.eval_losses,
                "messages": result.messages, "local_tokens": first[0].local_tokens if first else 0, "batches": batches,
                "end": {w: full_state(trainer, w) for w in want}})
    if state.rank != 0:  # keep the pickled answer small: only rank 0 sends full tensors
        out.pop("grads", None)
        out["start"], out["end"] = {}, {}
    else:
        records = [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines()]
        out["setup"] = next(record for record in records if record.get("kind") == "setup")
    return out


def _per_rank_mean_tokens(loss_masks: list[torch.Tensor], group: dist.ProcessGroup) -> float:
    """The classic bug: each rank normalises by its OWN token count (times the group size, i.e. the
    gradient becomes the mean over ranks of per-rank mean losses)."""
    return float(sum(float(m.sum()) for m in loss_masks)) * dist.get_world_size(group)


def train_with_per_rank_mean_loss(state: ParallelState, prefix: str, run_dir: str) -> dict[str, Any]:
    """``train_layout`` for one step with the per-rank-mean reduction patched in (negative control)."""
    original = trainer_module.global_loss_tokens
    trainer_module.global_loss_tokens = _per_rank_mean_tokens
    try:
        return train_layout(state, prefix, run_dir, until_step=1)
    finally:
        trainer_module.global_loss_tokens = original


def train_with_fsdp_averaging(state: ParallelState, prefix: str, run_dir: str) -> dict[str, Any]:
    """``train_layout`` with FSDP for one step, its gradient divide factor left at FSDP2's default (the mean)."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor
    FSDPModule.set_gradient_divide_factor = lambda self, factor: None  # type: ignore[method-assign]
    try:
        return train_layout(state, prefix, run_dir, {"parallel.fsdp": True}, until_step=1)
    finally:
        FSDPModule.set_gradient_divide_factor = original  # type: ignore[method-assign]


def train_until_nan(state: ParallelState, prefix: str, run_dir: str, nan_step: int) -> str:
    """Train with the last rank's token losses turned to NaN at ``nan_step``; returns the error raised."""
    trainer = Trainer(tiny_config(prefix, run_dir, state.dims), state)
    forward = trainer.model.forward

    def poisoned_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        losses = forward(*args, **kwargs)
        if trainer.step + 1 == nan_step and state.rank == state.world_size - 1:
            losses = losses * float("nan")
        return losses

    trainer.model.forward = poisoned_forward  # type: ignore[method-assign]
    try:
        trainer.train()
    except NonFiniteLossError as error:
        return f"{error} (after {len(trainer.result.losses)} steps)"
    return "no error"


def train_with_failing_save(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any],
                            fail_at_step: int, failing_rank: int) -> str:
    """Train with periodic saves; the save at ``fail_at_step`` dies part way: ``failing_rank`` fails while
    writing its shards after the others wrote theirs. Returns the error every rank saw."""
    writer = dcp.FileSystemWriter
    original = writer.write_data
    trainer = Trainer(tiny_config(prefix, run_dir, state.dims, **overrides), state)

    def failing_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if trainer.step == fail_at_step and state.rank == failing_rank:
            raise OSError(f"simulated crash of rank {state.rank} while writing step {fail_at_step}")
        return original(self, plan, planner)

    writer.write_data = failing_write_data  # type: ignore[method-assign]
    try:
        trainer.train()
    except BaseException as error:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        return f"{type(error).__name__}: {error}"
    finally:
        writer.write_data = original  # type: ignore[method-assign]
    return "no error"
