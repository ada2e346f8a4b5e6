"""The training loop: micro-batches with gradient accumulation, the exact DP x CP loss reduction, AdamW,
evaluation, checkpoints and metrics.

``Trainer(config, state)`` builds everything on the current parallel state (``parallel.state``) and
resumes from ``checkpoint.load`` (or ``checkpoint.save``'s ``latest``); ``train()`` runs to
``train.steps``. Collectives use the groups of ``state``: the loss token count, the loss and the
gradients are summed over DP x CP (by FSDP2 with ``parallel.fsdp``, else by DDP), the gradient norm
over TP (and over DP x CP for FSDP's sharded gradients).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cp_train import build
from cp_train.checkpoint.dcp import ShardedState, save_checkpoint
from cp_train.checkpoint.files import resume_hint, resume_source
from cp_train.checkpoint.resume import restore_run
from cp_train.checkpoint.rng import derived_seed, seed_everything
from cp_train.config.hf_init import hf_init_message
from cp_train.config.schema import Config, dump_yaml
from cp_train.config.validate import check_parallel_state, validate
from cp_train.data.loader import ATTENTION_PLAN
from cp_train.errors import agree
from cp_train.loss import global_loss_tokens, masked_loss_sum, reduce_loss, reduce_sums
from cp_train.memory.cpu_memory import keep_freed_memory
from cp_train.memory.state_bytes import setup_record
from cp_train.metrics.sinks import MetricsSinks
from cp_train.metrics.throughput import (
    IntervalMeter,
    peak_memory_gib,
    peak_memory_reserved_gib,
    peak_tflops,
    reset_peak_memory,
)
from cp_train.optim import LRSchedule, build_optimizer, clip_gradients, global_grad_norm
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.dp.ddp import gradient_sync
from cp_train.parallel.mesh.state import ParallelState
from cp_train.results import BatchLoss, NonFiniteLossError, StepResult, TrainResult

MicroBatch = dict[str, Any]  # per-token tensors [B, local_seqlen], and the loader's ATTENTION_PLAN


class Trainer:
    """One training run on ``state`` (every rank constructs it; construction and ``train`` are collective)."""

    def __init__(self, config: Config, state: ParallelState) -> None:
        self.config, self.state = config, state
        self.dp = validate(config, state.world_size)
        check_parallel_state(config, state, self.dp)
        self.device = build.select_device(state)
        if config.train.deterministic:
            build.use_deterministic_algorithms()
        if self.device.type == "cpu" and config.train.cpu_keep_freed_memory:
            keep_freed_memory()
        self.autocast_dtype = build.autocast_dtype(config, self.device)
        seed_everything(derived_seed(config.train.seed, state.rank))
        self.sources = build.resolve_data(config, state)
        self.run_name = config.run_name(self.dp)
        self.run_dir = build.run_dir_of(config, self.run_name)
        agree(self._check_directories)
        ckpt = config.checkpoint
        resume = agree(lambda: resume_source(ckpt.load, ckpt.save if ckpt.auto_resume else None))
        self._resumed_from = resume
        hf_dir = None if resume is not None else config.checkpoint.init_from_hf
        # model: the GPTModel (sharded by FSDP2 in place); module: what runs it (the DDP wrapper or the model)
        self.model, self.module = build.build_model(config, state, self.device, hf_dir, self.autocast_dtype)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, config.optimizer, self.device)
        self.schedule = LRSchedule(config.optimizer, config.schedule, config.train.steps)
        self.sharded = ShardedState(self.model, self.optimizer, state)
        self.result = TrainResult()
        self.result.run_dir = str(self.run_dir)
        self.step, consumed = 0, 0
        self._pending_messages: list[str] = []
        if hf_dir is not None:
            self._note(hf_init_message(config))
        for note in config.deprecations:
            self._note(note)
        if resume is not None:
            consumed = self._load(resume)
        self.train_data, self.valid_data = build.build_datasets(config, self.sources, state)
        self.planner = self.model.sample_planner() if config.data.document_mask else None
        self.loader = build.build_loader(config, self.train_data, state, consumed, self.device, self.planner)
        self.grad_callback: Callable[[int], None] | None = None  # called after the gradient sum (tests)
        self._last_saved = self.step if resume is not None else -1

    # ----------------------------------------------------------------------------------- setup
    def _check_directories(self) -> None:
        """The run directory and the checkpoint directory must take files before step 1 (rank 0 writes both
        the metrics and the checkpoint metadata)."""
        if self.state.rank == 0:
            build.ensure_writable_dir(self.run_dir, "logging.dir (--run-dir)")
            if self.config.checkpoint.save:
                build.ensure_writable_dir(Path(self.config.checkpoint.save), "checkpoint.save (--save)")

    def _load(self, path: Path) -> int:
        self.step, consumed, notes = restore_run(path, self.config, self.sharded, self.optimizer, self.state)
        for note in notes:
            self._note(note)
        return consumed

    def _note(self, text: str) -> None:
        self.result.messages.append(text)
        self._pending_messages.append(text)

    # ------------------------------------------------------------------------------------ step
    def _to_device(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        return [{k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
                for mb in micro_batches]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _losses(self, mb: MicroBatch) -> tuple[torch.Tensor, CPPlan | None]:
        """Per-token losses of one micro-batch (attention per document when ``data.document_mask``) and the
        attention plan they used (None without a ring)."""
        documents = mb["document_ids"] if self.config.data.document_mask else None
        plan = mb.get(ATTENTION_PLAN)  # made by the loader (with the document mask)
        if plan is None:
            plan = self.model.attention_plan(mb["tokens"].shape[1], documents, mb["position_ids"])
        losses = self.module(mb["tokens"], mb["position_ids"], labels=mb["labels"], document_ids=documents, plan=plan)
        return losses, plan

    def forward_backward(self, micro_batches: list[MicroBatch]) -> BatchLoss:
        """Accumulate the gradients of one global batch (this rank's micro-batches).

        Each micro-batch backpropagates ``sum(masked token losses) / global loss tokens``; only the last
        backward reduces, so on return every gradient is summed over DP x CP (FSDP: this rank's shard of it)."""
        group = self.state.dp_cp.group
        self.optimizer.zero_grad(set_to_none=True)
        masks = [mb["loss_mask"] for mb in micro_batches]
        tokens = global_loss_tokens(masks, group)
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        areas, pairs = [0] * self.state.cp.size, 0  # attention work per CP rank, visible pairs in all
        for index, mb in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with gradient_sync(self.module, last, keep_gathered=not self.config.parallel.fsdp_reshard_after_forward):
                with self._autocast():
                    token_losses, plan = self._losses(mb)
                loss_sum = masked_loss_sum(token_losses, mb["loss_mask"])
                (loss_sum / tokens).backward()
            local_sum += loss_sum.detach().double()
            if plan is not None:
                areas, pairs = [a + b for a, b in zip(areas, plan.areas, strict=True)], pairs + plan.pairs
        local_tokens = float(sum(float(m.sum()) for m in masks))
        imbalance = max(areas) / (sum(areas) / len(areas)) if sum(areas) else 1.0
        return BatchLoss(reduce_loss(local_sum, tokens, group), tokens, local_tokens, float(local_sum), imbalance,
                         pairs)

    def _diverged(self, what: str, detail: str = "") -> NonFiniteLossError:
        hint = resume_hint(self.config.checkpoint.save, self._resumed_from)
        return NonFiniteLossError(f"{what} at step {self.step + 1}{detail}: stopping the run before the update; "
                                  f"{hint} (and a lower optimizer.lr), or check the data")

    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult:
        """One optimizer step on one global batch (this rank's micro-batches, already CP-sliced)."""
        lr = self.schedule.apply(self.optimizer, self.step)
        loss, tokens, local_tokens, _, imbalance, pairs = self.forward_backward(self._to_device(micro_batches))
        if not math.isfinite(loss):
            raise self._diverged(f"loss is {loss}")
        if self.grad_callback is not None:
            self.grad_callback(self.step + 1)
        norm = global_grad_norm(self.params, self.state.tp.group, self.state.dp_cp.group)
        if not math.isfinite(float(norm)):
            raise self._diverged(f"gradient norm is {float(norm)}", f" (loss {loss:.4f})")
        clip_gradients(self.params, self.config.optimizer.clip_grad, norm)
        self.optimizer.step()
        self.step += 1
        if self.planner is not None:  # every CP rank's plan counts its replica's pairs: the sum over DP
            pairs = reduce_sums([pairs / self.state.cp.size], self.state.dp_cp.group, self.device)[0]
        return StepResult(loss, float(norm), lr, tokens, local_tokens, imbalance,
                          pairs if self.planner is not None else None)

    # ------------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the validation batches (exact over DP x CP), or NaN without a validation split."""
        if self.valid_data is None:
            return float("nan")
        loader = build.build_loader(self.config, self.valid_data, self.state, 0, self.device, self.planner)
        self.module.eval()
        local_sum, local_tokens = 0.0, 0.0
        for micro_batches in loader:
            for mb in self._to_device(micro_batches):
                with self._autocast():
                    token_losses, _ = self._losses(mb)
                local_sum += float(masked_loss_sum(token_losses, mb["loss_mask"]))
                local_tokens += float(mb["loss_mask"].sum())
        self.module.train()
        total, tokens = reduce_sums([local_sum, local_tokens], self.state.dp_cp.group, self.device)
        return total / max(tokens, 1.0)

    # ------------------------------------------------------------------------------------ loop
    def save(self) -> None:
        ckpt = self.config.checkpoint
        if not ckpt.save or self._last_saved == self.step:
            return
        meta = {"step": self.step, "consumed_samples": self.loader.consumed_samples,
                "scheduler": {"step": self.step, **self.schedule.state_dict()},
                "layout": {**self.state.dims, "world_size": self.state.world_size,
                           "cp_layout": self.config.parallel.cp_layout,
                           "cp_algorithm": self.config.parallel.cp_algorithm, "fsdp": self.config.parallel.fsdp},
                "config": self.config.to_dict(), "torch": torch.__version__}
        path = save_checkpoint(ckpt.save, self.step, self.sharded, meta, self.state, keep=ckpt.keep)
        self._last_saved = self.step
        self._note(f"saved checkpoint {path}")

    def _sinks(self) -> MetricsSinks:
        config = self.config
        layout = {**self.state.dims, "world_size": self.state.world_size, "seq_len": config.data.seq_len}
        sinks = MetricsSinks(self.state.rank == 0, self.run_dir, self.run_name, config.train.steps, self.step,
                             config.to_dict(), layout, config.logging.wandb, config.logging.wandb_project,
                             config.logging.wandb_mode, config.logging.console, append=self.step > 0)
        if self.state.rank == 0:
            (self.run_dir / "config.yaml").write_text(dump_yaml(config))
        return sinks

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to ``train.steps`` (or stop after ``until_step``), logging, evaluating and saving on the way."""
        config, state = self.config, self.state
        last = min(config.train.steps, until_step or config.train.steps)
        sinks = self._sinks()
        sizes = build.describe(self.model, state)
        peak, peak_source = peak_tflops(self.device, config.logging.peak_tflops, config.logging.cpu_peak_tflops)
        sharding = "FSDP over dp x cp" if config.parallel.fsdp else "DDP"
        sinks.message(f"run {self.run_name}: {sizes['parameters']:,} parameters ({sizes['parameters_per_rank']:,} "
                      f"per rank, {sharding}), world {state.world_size} = tp {state.tp.size} x cp {state.cp.size} x "
                      f"dp {state.dp.size}, device {self.device}, run dir {self.run_dir}; peak {peak} TFLOP/s per "
                      f"device ({peak_source})")
        self._flush(sinks)
        meter = IntervalMeter.for_model(config.model, config.data.seq_len, config.train.global_batch_size,
                                        state.world_size, peak)
        reset_peak_memory(self.device)
        batches = iter(self.loader)
        first = self.step
        try:
            while self.step < last:
                started = time.perf_counter()
                micro_batches = next(batches)
                loaded = time.perf_counter()
                out = self.train_step(micro_batches)
                if self.step == first + 1:  # gradients and optimizer state exist now: measure them
                    sinks.log(self._setup_record(sizes, first))
                meter.add(out.loss, time.perf_counter() - started, loaded - started, out.imbalance, out.attention_pairs)
                self.result.losses[self.step] = out.loss
                self.result.grad_norms[self.step] = out.grad_norm
                if self.step % config.logging.interval == 0 or self.step == last:
                    sinks.log(meter.record(self.step, out.lr, out.grad_norm, self.loader.consumed_samples,
                                           config.data.seq_len, peak_memory_gib(self.device),
                                           peak_memory_reserved_gib(self.device)))
                paused = time.perf_counter()
                if config.train.eval_interval and (self.step % config.train.eval_interval == 0 or self.step == last):
                    self._log_eval(sinks)
                if config.checkpoint.interval and self.step % config.checkpoint.interval == 0:
                    self.save()
                    self._flush(sinks)
                meter.exclude(time.perf_counter() - paused)
            if self.step == first:
                sinks.log(self._setup_record(sizes, first))
            self.save()
            self._flush(sinks)
        finally:
            sinks.close()
        self.result.final_step = self.step
        return self.result

    def _setup_record(self, sizes: dict[str, int], step: int) -> dict:
        parallel = self.config.parallel
        return setup_record(self.model, self.optimizer, sizes, {
            "step": step, **self.state.dims, "world_size": self.state.world_size, "fsdp": parallel.fsdp,
            "fsdp_reshard_after_forward": parallel.fsdp_reshard_after_forward})

    def _log_eval(self, sinks: MetricsSinks) -> None:
        loss = self.evaluate()
        self.result.eval_losses[self.step] = loss
        sinks.log({"kind": "eval", "step": self.step, "loss": loss,
                   "perplexity": math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss})

    def _flush(self, sinks: MetricsSinks) -> None:
        for text in self._pending_messages:
            sinks.message(text)
        self._pending_messages.clear()


def run_training(config: Config, state: ParallelState, until_step: int | None = None) -> TrainResult:
    """Build a ``Trainer`` on ``state`` and train; returns the per-step losses and the messages."""
    return Trainer(config, state).train(until_step)

