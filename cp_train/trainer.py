"""The training loop: micro-batches with gradient accumulation, the exact DP x CP loss reduction, AdamW,
evaluation, checkpoints and metrics.

``Trainer(config, state)`` builds its parts on the current parallel state (``parallel.state``) with
``run_parts`` (the environment, the training state, the data) and resumes from ``checkpoint.load`` (or
``checkpoint.save``'s ``latest``); ``train()`` runs to ``train.steps``. Collectives use the groups of
``state``: the loss token count, the loss and the gradients are summed over DP x CP (by FSDP2 with
``parallel.fsdp``, else by DDP), the gradient norm over TP (and over DP x CP for FSDP's sharded gradients).

No step reads the device (a read stalls the GPU's launch queue): the step scalars (``metrics.step_scalars``)
are read in one go, before the update, at log (``logging.interval``), evaluation and checkpoint steps. A
non-finite loss or gradient norm stops the run when read; a step that diverged in between is not skipped (that
would take a read per step), but neither evaluated nor saved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cp_train import run_log, run_parts
from cp_train.checkpoint.async_save import saver_for
from cp_train.checkpoint.dcp import read_meta
from cp_train.config.validate import with_accumulation
from cp_train.data.loader import CP_PLAN
from cp_train.eval.periodic import PeriodicEval
from cp_train.loss import device_sums, global_loss_tokens, masked_loss_sum, reduce_loss
from cp_train.memory.fsdp_reduce import fsdp_reduce_for_run
from cp_train.memory.out_of_memory import out_of_memory, where_in_run
from cp_train.metrics.step_scalars import DeviceBatch, DeviceStep, UnreadSteps, divergence
from cp_train.metrics.throughput import reset_peak_memory
from cp_train.optim import clip_gradients, global_grad_norm
from cp_train.parallel.dp.ddp import gradient_sync
from cp_train.parallel.tp.fp8 import precompute_fp8_scales
from cp_train.preemption import Preemption
from cp_train.results import NonFiniteLossError, StepResult, TrainResult
from cp_train.runtime.collective_check import CollectiveGuard
from cp_train.runtime.collector import ScheduledCollection
from cp_train.runtime.cp_check import CPCheck
from cp_train.runtime.device_batches import MicroBatch, loss_tokens, to_device
from cp_train.runtime.profiling import StepProfiler
from cp_train.runtime.replica_check import ReplicaCheck
from cp_train.runtime.validation import validation_loss

if TYPE_CHECKING:
    from cp_train.config.schema import Config
    from cp_train.metrics.writers import MetricWriters
    from cp_train.parallel.cp.plan.batch_plan import CPPlan
    from cp_train.parallel.mesh.state import ParallelState


class Trainer:
    """One training run on ``state`` (every rank constructs it; construction and ``train`` are collective)."""

    # ------------------------------------------------------------------------------------ build
    def __init__(self, config: Config, state: ParallelState) -> None:
        config = with_accumulation(config, state.world_size)  # the global batch of gradient_accumulation_steps
        self.config, self.state = config, state
        self.collectives = (CollectiveGuard(state, config.parallel.timeout_minutes)
                            if config.parallel.check_collectives else None)  # recording from here on
        self.env = run_parts.prepare_environment(config, state)  # checks, device, seed, data sources, resume source
        try:  # model, module, optimizer, schedule, sharded
            self.training = run_parts.build_training_state(self.env)
        except torch.OutOfMemoryError as error:  # one line: the dry run's plan and what to change
            raise out_of_memory(config, state, "building the model", self.env.device, error) from None
        # parallel.fsdp_reduce with auto resolved as the dry run does (against this device's memory on CUDA)
        self.fsdp_reduce, why = fsdp_reduce_for_run(config, state.world_size, self.env.device)
        self.result = TrainResult(run_dir=str(self.env.run_dir))
        self.prediction: dict | None = None  # the planner's, for this run's layout (``train``)
        self.step, consumed = 0, 0
        self._pending_messages: list[str] = []
        for note in self.env.notes:
            self._note(note)
        if config.parallel.fsdp and config.parallel.fsdp_reduce == "auto":
            self._note(f"parallel.fsdp_reduce auto: {self.fsdp_reduce} ({why})")
        if self.env.resumed_from is not None:
            self.step, consumed, notes = self.training.resume(self.env)
            for note in notes:
                self._note(note)
        self.data = run_parts.build_run_data(self.env, self.model, consumed)  # datasets, planner, loader
        self.grad_callback: Callable[[int], None] | None = None  # called after the gradient sum (tests)
        self._unread = UnreadSteps()  # steps whose scalars are still on the device
        self._last_saved = self.step if self.env.resumed_from is not None else -1
        self.saver = saver_for(state, config.checkpoint, config.parallel.timeout_minutes)  # async_save.py
        self.resumed_meta = read_meta(self.env.resumed_from) if self.env.resumed_from is not None else None
        self._wandb: dict[str, str] | None = None  # the wandb run's id and group (rank 0), saved in checkpoints
        self.long_eval = PeriodicEval(config)  # eval.every: long-context tasks (cp_train/eval)
        self.cp_check = CPCheck(config, state, self.model, self.loader, self.device, self.autocast_dtype,
                                self._autocast)  # train.check_cp_every (cp_train/runtime/cp_check.py)
        self.replica_check = ReplicaCheck(config, state, self.model)  # train.check_replicas_every
        self.last_batch: DeviceBatch | None = None  # the last step's (forward_backward)

    # the parts' attributes under their own names
    dp, device, autocast_dtype, sources, run_name, run_dir = run_parts.part_attributes(
        "env", "dp", "device", "autocast_dtype", "sources", "run_name", "run_dir")
    model, module, params, optimizer, schedule, sharded = run_parts.part_attributes(
        "training", "model", "module", "params", "optimizer", "schedule", "sharded")
    train_data, valid_data, planner, loader = run_parts.part_attributes(
        "data", "train_data", "valid_data", "planner", "loader")

    def _note(self, text: str) -> None:
        self.result.messages.append(text)
        self._pending_messages.append(text)

    # ------------------------------------------------------------------------------------ step
    def _to_device(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        return to_device(micro_batches, self.device)  # the tensors and CP plans, non-blocking (device_batches.py)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _losses(self, mb: MicroBatch) -> tuple[torch.Tensor, CPPlan | None]:
        """Per-token losses of one micro-batch (attention per document when ``data.document_mask``) and the
        CP plan they used (None without a ring)."""
        documents = mb["document_ids"] if self.config.data.document_mask else None
        plan = mb.get(CP_PLAN)  # made by the loader (with the document mask)
        if plan is None:
            plan = self.model.build_cp_plan(mb["tokens"].shape[1], documents, mb["position_ids"])
        losses = self.module(mb["tokens"], mb["position_ids"], labels=mb["labels"], document_ids=documents, plan=plan)
        return losses, plan

    def forward_backward(self, micro_batches: list[MicroBatch]) -> DeviceBatch:
        """Accumulate the gradients of one global batch (this rank's micro-batches); reads nothing to the host.

        Each micro-batch backpropagates ``sum(masked token losses) / global loss tokens``; only the last
        backward reduces (FSDP with ``fsdp_reduce`` per_microbatch, set or resolved from auto: every one), so on
        return every gradient is summed over DP x CP (FSDP: this rank's shard of it)."""
        group = self.state.dp_cp.group
        self.optimizer.zero_grad(set_to_none=True)
        masks = [mb["loss_mask"] for mb in micro_batches]
        tokens = torch.as_tensor(global_loss_tokens(masks, group), dtype=torch.float64, device=self.device)
        divisor = tokens.float()  # what dividing by the count as a Python number computed
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        first: torch.Tensor | None = None  # the first micro-batch's loss sum (the CP check's)
        areas, pairs = [0] * self.state.cp.size, 0  # attention work per CP rank, visible pairs in all
        parallel = self.config.parallel
        every = parallel.fsdp and self.fsdp_reduce == "per_microbatch"  # else only the last backward reduces
        for index, mb in enumerate(micro_batches):
            reduce = every or index == len(micro_batches) - 1
            with gradient_sync(self.module, reduce, keep_gathered=not parallel.fsdp_reshard_after_forward):
                with self._autocast():
                    token_losses, plan = self._losses(mb)
                loss_sum = masked_loss_sum(token_losses, mb["loss_mask"])
                (loss_sum / divisor).backward()
            local_sum += loss_sum.detach().double()
            first = loss_sum.detach() if index == 0 else first
            if plan is not None:  # the pairs each layer's (window's) plan counts, averaged over the layers
                areas = [a + b for a, b in zip(areas, plan.areas, strict=True)]
                pairs += plan.pairs if self.model.layer_pairs is None else self.model.layer_pairs
        local_tokens = float(sum(loss_tokens(mb) for mb in micro_batches))
        imbalance = max(areas) / (sum(areas) / len(areas)) if sum(areas) else 1.0
        return DeviceBatch(loss=reduce_loss(local_sum, tokens, group), tokens=tokens, local_tokens=local_tokens,
                           local_loss_sum=local_sum, imbalance=imbalance, attention_pairs=pairs,
                           first_loss_sum=first)

    def read_steps(self) -> list[tuple[int, StepResult]]:
        """The steps not read yet, read to the host (one read of the device; none if none) and returned in order;
        each is recorded in ``result`` (losses, gradient norms), or stops the run if it diverged."""
        read = self._unread.read()
        for step, out in read:
            found = divergence(step, out, self.step, self.config.logging.interval)
            if found is not None:
                raise NonFiniteLossError(f"{found}; {self.env.where_to_resume()} (and a lower optimizer.lr), or "
                                         f"check the data")
            self.result.losses[step], self.result.grad_norms[step] = out.loss, out.grad_norm
        return read

    def _step(self, micro_batches: list[MicroBatch], read: bool) -> list[tuple[int, StepResult]]:
        """One optimizer step; its scalars stay on the device unless ``read``: then every unread step is read
        (``read_steps``, returned) before the update, which a diverged step never gets."""
        lr = self.schedule.apply(self.optimizer, self.step)
        batch = self.last_batch = self.forward_backward(self._to_device(micro_batches))
        if self.grad_callback is not None:
            self.grad_callback(self.step + 1)
        norm = global_grad_norm(self.params, self.state.tp.group, self.state.fsdp_shard.group)
        pairs = None  # every CP rank's plan counts its replica's pairs: the sum over DP
        if self.planner is not None:
            pairs = device_sums([batch.attention_pairs / self.state.cp.size], self.state.dp_cp.group, self.device)[0]
        self._unread.add(DeviceStep.of(self.step + 1, lr, batch, norm, pairs))
        steps = self.read_steps() if read else []
        clip_gradients(self.params, self.config.optimizer.clip_grad, norm)
        self.optimizer.step()
        precompute_fp8_scales(self.params)  # FSDP's FP8 gathers: their scales in one all-reduce (parallel/tp/fp8.py)
        self.step += 1
        return steps

    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult:
        """One optimizer step on one global batch (this rank's micro-batches, CP-sliced), read before its update."""
        return self._step(micro_batches, read=True)[-1][1]

    # ------------------------------------------------------------------------------------ eval
    def evaluate(self) -> float:
        """Mean loss over the validation batches (exact over DP x CP), or NaN without a validation split."""
        return validation_loss(self)

    # ------------------------------------------------------------------------------------ save
    def save(self) -> None:
        ckpt = self.config.checkpoint
        if not ckpt.save or self._last_saved == self.step:
            return
        self.read_steps()  # a diverged model is not saved
        for line in self.saver.save(ckpt.save, self.step, self.sharded, run_log.checkpoint_meta(self), ckpt.keep):
            self._note(line)
        self._last_saved = self.step

    # ------------------------------------------------------------------------------------ loop
    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to ``train.steps`` (or stop after ``until_step``), logging, evaluating and saving on the way; a
        SIGTERM, SIGUSR1 or Ctrl-C on any rank saves and stops after the step it came in (``preemption``). Python's
        collector runs on the run's schedule (``train.gc_interval``, ``runtime/collector.py``)."""
        config, state = self.config, self.state
        last = min(config.train.steps, until_step or config.train.steps)
        writers, sizes, check, meter = run_log.open_run(self)  # the first lines; the planner's prediction
        reset_peak_memory(self.device)
        batches = iter(self.loader)
        first = self.step
        times: dict[int, tuple[float, float]] = {}  # step -> (step time, data time), until the meter has it
        halted: str | None = None  # why the run stopped early (preemption.py)
        try:
            with Preemption(config.train, self.env.started) as preemption, \
                    ScheduledCollection(config.train.gc_interval) as collection, \
                    StepProfiler(config.logging, state.rank, self.device, self.run_dir, first) as profiler:
                if note := profiler.note():  # logging.profile: resumed past its steps
                    self._note(note)
                while self.step < last:
                    profiler.before_step(self.step + 1)  # logging.profile (runtime/profiling.py)
                    started = time.perf_counter()
                    micro_batches = next(batches)
                    loaded = time.perf_counter()
                    log, evaluate, save = run_parts.due_events(config, self.step + 1, last)
                    checked = self.cp_check.due(self.step + 1)  # then also a log step
                    log, checking = log or checked, time.perf_counter()
                    if checked:
                        self.cp_check.before_step()  # the first micro-batch's loss without CP, on these weights
                    checking = time.perf_counter() - checking  # not the step's time
                    read = self._step(micro_batches, read=log or evaluate or save)  # checked before the update
                    cp_error = self.cp_check.after_step(self.step, self.last_batch.first_loss_sum) if checked else None
                    if note := self.replica_check.after_step(self.step):  # the replicas compared (collective)
                        self._note(note)
                    collection.after_step(self.step, self.step == first + 1)
                    if self.step == first + 1:  # gradients and optimizer state exist now: measure them
                        writers.log(run_log.setup_record(self, sizes, first))
                    times[self.step] = (time.perf_counter() - started - checking, loaded - started)
                    stop = preemption.agreed(state.host_group, self.step, last)  # a signal, the time: save, stop
                    if stop and not read:  # the last step before the stop is read and logged as a log step's
                        read, log = self.read_steps(), True
                    meter.add_steps(read, times)
                    if log:  # the interval's record, checked against the planner's prediction
                        run_log.log_interval(self, writers, meter, read[-1][1], cp_error, check)
                    paused = time.perf_counter()
                    profiled = profiler.after_step(self.step)  # the trace written after its last step
                    if profiled is not None:
                        writers.log(profiled)
                    if evaluate and not stop:
                        run_log.log_eval(self, writers)
                    if self.long_eval.due(self.step, last) and not stop:
                        self.long_eval.run(self, writers)  # eval.every: cp_train/eval/periodic.py
                    if save or stop:
                        self.save()
                        self._flush(writers)
                    if stop:
                        halted = stop
                        break
                    meter.exclude(time.perf_counter() - paused)
            if self.step == first:
                writers.log(run_log.setup_record(self, sizes, first))
            self.save()
            for line in self.saver.wait():  # the checkpoint is complete before the run ends
                self._note(line)
            for line in check.summary():
                self._note(line)
            if halted:  # the last line
                self._note(Preemption.stopped(halted, self.step, bool(config.checkpoint.save)))
            self._flush(writers)
        except torch.OutOfMemoryError as error:  # one line: the dry run's plan and what to change
            raise out_of_memory(config, state, where_in_run(error, self.step), self.device, error) from None
        finally:
            try:  # a failed run still completes the save in flight; the run's error stays the one raised
                self.saver.close()
            except Exception as error:  # noqa: BLE001 - reported beside the run's error, never lost
                self._note(f"the checkpoint written behind training failed as well: {error}")
                self._flush(writers)
            writers.close(quiet=halted is not None)  # an early stop: its line is the last
            if self.collectives is not None:
                self.collectives.close()
        self.result.final_step = self.step
        return self.result

    def _flush(self, writers: MetricWriters) -> None:
        for text in self._pending_messages:
            writers.message(text)
        self._pending_messages.clear()


def run_training(config: Config, state: ParallelState, until_step: int | None = None) -> TrainResult:
    """Build a ``Trainer`` on ``state`` and train; returns the per-step losses and the messages."""
    return Trainer(config, state).train(until_step)
