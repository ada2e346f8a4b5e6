"""The records a training run logs, built from the trainer's state: the run's opening lines, setup, intervals (with
the max over ranks of step time and memory), evaluations, and the event of a layout change on resume."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch

from cp_train import run_parts
from cp_train.metrics.throughput import (
    FP8_PEAK_RATIO,
    IntervalMeter,
    device_memory_gib,
    max_over_ranks,
    peak_memory_gib,
    peak_memory_reserved_gib,
    peak_tflops,
)
from cp_train.metrics.window_bytes import kv_bytes_per_layer
from cp_train.optim import global_param_norm
from cp_train.parallel.kernels.select import chosen_backends
from cp_train.parallel.mesh.rank_groups import compute_rank_groups, crossing_nodes
from cp_train.parallel.tp.fp8 import fp8_layers
from cp_train.perf.run_check import PlannerCheck
from cp_train.results import StepResult

if TYPE_CHECKING:
    from cp_train.metrics.writers import MetricWriters

Trainer = Any  # the running ``cp_train.trainer.Trainer`` (not imported: it imports this module)


def open_run(trainer: Trainer) -> tuple[MetricWriters, dict[str, int], PlannerCheck, IntervalMeter]:
    """The run's writers (resuming its wandb run), its parameter counts, the planner's check of its steps and the
    interval meter; logs the layout change since the checkpoint, the start line and the planner's notes."""
    config, state, env = trainer.config, trainer.state, trainer.env
    writers = run_parts.open_writers(env, trainer.step, (trainer.resumed_meta or {}).get("wandb"))
    trainer._wandb = writers.wandb_state()
    for event in layout_event(trainer.resumed_meta, trainer):
        writers.log(event)
    sizes = trainer.training.sizes(state)
    peak, peak_source = peak_tflops(trainer.device, config.logging.peak_tflops, config.logging.cpu_peak_tflops)
    writers.message(run_parts.start_line(env, state, sizes, f"{peak} TFLOP/s per device ({peak_source})"))
    check = PlannerCheck(config, state.world_size, trainer.device, peak, peak_source, trainer.data.train_data)
    trainer.prediction = check.prediction
    for line in check.notes:
        trainer._note(line)
    trainer._flush(writers)
    meter = IntervalMeter.for_model(config.model, config.data.seq_len, config.train.global_batch_size,
                                    state.world_size, peak)
    return writers, sizes, check, meter


def log_interval(trainer: Trainer, writers: MetricWriters, meter: IntervalMeter, out: StepResult,
                 cp_error: float | None, check: PlannerCheck) -> None:
    """Log the record of the interval ending at ``trainer.step`` (with the CP check's error, ``cp_error``, where the
    step was checked), compare the ranks' collectives (``parallel.check_collectives``) and the planner's prediction."""
    record = interval_record(trainer, meter, out)
    if cp_error is not None:
        record["cp_check_rel_err"] = cp_error
    writers.log(record)
    if trainer.collectives is not None:
        trainer.collectives.at_log_step(trainer.step)
    for line in check.observe(record):
        trainer._note(line)
    trainer._flush(writers)


def interval_record(trainer: Trainer, meter: IntervalMeter, out: StepResult) -> dict[str, Any]:
    """The record of the interval ending at ``trainer.step`` (``out``: its last step's scalars). Step time and peak
    memory are also maxed over every rank (one collective over the host group), memory also as a percentage of
    the device's."""
    config, device = trainer.config, trainer.device
    memory = peak_memory_gib(device)
    record = meter.record(trainer.step, out.lr, out.grad_norm, trainer.loader.consumed_samples, config.data.seq_len,
                          memory, peak_memory_reserved_gib(device))
    step_time, memory = max_over_ranks([record["step_time_s"], memory], trainer.state.host_group)
    total = device_memory_gib(device)
    record.update({"step_time_max_s": step_time, "peak_memory_max_gib": memory,
                   "peak_memory_pct": 100.0 * memory / total if total else None})
    if config.logging.params_norm:  # after the interval's last update (collective over TP and FSDP's shards)
        state = trainer.state
        record["params_norm"] = float(global_param_norm(trainer.params, state.tp.group, state.fsdp_shard.group))
    return record


def setup_record(trainer: Trainer, sizes: dict[str, int], step: int) -> dict[str, Any]:
    """The ``{"kind": "setup"}`` record (collective: it measures every rank's state bytes)."""
    parallel, state = trainer.config.parallel, trainer.state
    return trainer.training.setup_record(sizes, {
        "step": step, **state.dims, "world_size": state.world_size, "fsdp": parallel.fsdp,
        "fsdp_reshard_after_forward": parallel.fsdp_reshard_after_forward, "fsdp_reduce": trainer.fsdp_reduce,
        "sequence_parallel": trainer.model.parallel.sequence_parallel,
        "attention_kernels": ", ".join(chosen_backends()),
        "compiled": ", ".join(trainer.model.compiled_parts) or "nothing", "prediction": trainer.prediction,
        "kv_bytes_per_layer": _kv_bytes(trainer), "nodes": _nodes(trainer), "fp8": trainer.config.model.fp8,
        "fp8_linears": len(fp8_layers(trainer.model)), "mfu_convention": _mfu_convention(trainer)})


def _mfu_convention(trainer: Trainer) -> str:
    text = "mfu: attention under the causal (and document) mask; mfu_dense: attention in full"
    if trainer.config.model.fp8 == "none":
        return text
    return (f"{text}; both at the bf16 peak; mfu_fp8_peak: the blocks' FP8 linears at the FP8 peak "
            f"({FP8_PEAK_RATIO:g}x bf16's), the rest at the bf16 peak")


def _nodes(trainer: Trainer) -> dict[str, Any]:
    """Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``), the kinds of group that cross nodes, and the ranks this
    rank's FSDP shards over (``dp_cp``, or a replica's under HSDP)."""
    state = trainer.state
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", state.world_size))
    groups = compute_rank_groups(state.world_size, state.tp.size, state.cp.size, state.dp.size,
                                 state.cp_ulysses.size if state.cp_ulysses else 1, state.dp_replicate)
    return {"ranks_per_node": per_node, "crossing": list(crossing_nodes(groups, per_node)),
            "fsdp_shard_ranks": list(state.fsdp_shard.ranks), "dp_replicate": state.dp_replicate}


def _kv_bytes(trainer: Trainer) -> dict[str, int]:
    """K/V bytes this rank receives per attention layer, full and per sliding window (``window_bytes.py``)."""
    model, mp = trainer.config.model, trainer.model.parallel
    dtype = trainer.autocast_dtype or next(trainer.model.parameters()).dtype
    return kv_bytes_per_layer(model.windows, mp.algorithm, mp.attention_layout, mp.cp_size, mp.cp_rank,
                              mp.cp.ulysses_size,
                              trainer.config.data.seq_len // mp.cp_size, trainer.config.train.micro_batch_size,
                              model.num_kv_heads // mp.tp_size, model.head_dim, dtype)


def log_eval(trainer: Trainer, writers: MetricWriters) -> None:
    """Evaluate (collective) and log the record."""
    loss = trainer.evaluate()
    trainer.result.eval_losses[trainer.step] = loss
    writers.log({"kind": "eval", "step": trainer.step, "loss": loss,
               "perplexity": math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss})


def checkpoint_meta(trainer: Trainer) -> dict[str, Any]:
    """A checkpoint's ``meta.json``: step, consumed samples, schedule, layout, config and the wandb run."""
    parallel, state = trainer.config.parallel, trainer.state
    return {"step": trainer.step, "consumed_samples": trainer.loader.consumed_samples,
            "scheduler": {"step": trainer.step, **trainer.schedule.state_dict()},
            "layout": {**state.dims, "world_size": state.world_size, "cp_layout": parallel.cp_layout,
                       "cp_algorithm": parallel.cp_algorithm, "fsdp": parallel.fsdp},
            "config": trainer.config.to_dict(), "torch": torch.__version__, "wandb": trainer._wandb}


def layout_name(layout: dict[str, Any]) -> str:
    return f"tp{layout.get('tp')}-cp{layout.get('cp')}-dp{layout.get('dp')}"


def layout_event(saved: dict[str, Any] | None, trainer: Trainer) -> list[dict[str, Any]]:
    """The ``{"kind": "event", "event": "layout_change"}`` record of a run resumed (``saved``: its checkpoint's
    meta) in another layout, or none."""
    if saved is None:
        return []
    before, after = layout_name(saved.get("layout", {})), layout_name(dict(trainer.state.dims))
    if before == after:
        return []
    return [{"kind": "event", "step": trainer.step, "event": "layout_change", "from": before, "to": after,
             "detail": f"{before} -> {after}"}]
