"""The dry run's plan (``cp_train/memory/dry_run.py``) against the measured peak of a real training step, on CPU.

    python -m bench.dry_run_check [--cases cp2-ring cp2-allgather ...] [--threads 2]

Each case is ``launch/configs/cpu-tiny.yaml`` with a few overrides (``CASES``), run as the real ``Trainer`` in
spawned gloo ranks (world = tp x cp x dp). After one warm-up step (the gradients and AdamW's state exist) every
rank counts the bytes of live tensor storage through the next full step (every micro-batch's forward and
backward, the gradient reduction, clipping and the optimizer step; ``bench/tensor_bytes.py``, which starts from
the parameters, gradients, optimizer state and buffers alive before the step). The largest rank's peak is
compared with the dry run's planned total of its largest rank (``RankMemory.total_bytes``, the reserve left
out): ``ratio`` = planned / measured, the target within 15% of 1. Prints one JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/dry_run_check.py` from anywhere

from bench.common import emit  # noqa: E402
from bench.tensor_bytes import LiveTensorBytes  # noqa: E402
from cp_train.config.schema import Config  # noqa: E402
from cp_train.config.sources import load_config  # noqa: E402
from cp_train.memory.dry_run import memory_plan  # noqa: E402
from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm  # noqa: E402
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402
from cp_train.trainer import Trainer  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "cpu-tiny.yaml"
MIB = 2.0**20
# cpu-tiny has 6 query heads and 2 kv heads: Ulysses at cp 4 needs the query heads divisible by 4 (8 heads of 24)
CASES: dict[str, dict[str, Any]] = {
    "cp1-ring": {"parallel.cp": 1},
    # one micro-batch a step: without DDP the backward makes the gradients as it goes (freed at each step's start);
    # under DDP they are views of its buckets, which stay allocated
    "cp1-one-micro-batch": {"parallel.cp": 1, "train.micro_batch_size": 8},
    "cp2-one-micro-batch": {"train.micro_batch_size": 8},
    "cp1-two-micro-batches": {"parallel.cp": 1, "train.micro_batch_size": 8, "train.global_batch_size": 16},
    "cp2-fsdp-one-micro-batch": {"parallel.fsdp": True, "train.micro_batch_size": 8},
    "cp2-ring": {},
    "cp2-allgather": {"parallel.cp_algorithm": "allgather"},
    "cp2-ulysses": {"parallel.cp_algorithm": "ulysses"},
    "cp4-ring": {"parallel.cp": 4},
    "cp4-allgather": {"parallel.cp": 4, "parallel.cp_algorithm": "allgather"},
    "cp4-ulysses": {"parallel.cp": 4, "parallel.cp_algorithm": "ulysses", "model.num_heads": 8},
    "cp4-hybrid": {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_size": 2},
    "tp2-cp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "tp2-cp2-nosp": {"parallel.tp": 2, "parallel.sequence_parallel": False},
    "tp2-cp2-sp-full": {"parallel.tp": 2, "parallel.sequence_parallel": True, "model.activation_checkpointing": "full"},
    "tp2-cp2-nosp-full": {"parallel.tp": 2, "parallel.sequence_parallel": False,
                          "model.activation_checkpointing": "full"},
    "cp2-fsdp-per_step": {"parallel.fsdp": True, "parallel.fsdp_reduce": "per_step", "train.micro_batch_size": 2},
    "cp2-fsdp-per_microbatch": {"parallel.fsdp": True, "parallel.fsdp_reduce": "per_microbatch",
                                "train.micro_batch_size": 2},
    "cp2-fp8-tensorwise": {"model.fp8": "tensorwise"},  # eager: FP8 casts of the linears' inputs and weights kept
    "cp2-fp8-rowwise": {"model.fp8": "rowwise"},
    "cp2-selective": {"model.activation_checkpointing": "selective"},
    "cp2-full": {"model.activation_checkpointing": "full"},
}
# a block's backward is the peak: one document per sample, 2k tokens per rank, a narrow MLP, small loss chunks
# and full checkpointing (``-block``); with 12 heads of 16, 4 kv heads and an MLP of 64, the attention's backward
# (``-attn``). They check the CP algorithms' buffers, which the head's backward hides in the cases above.
BLOCK_BOUND = {"data.seq_len": 512, "data.document_mask": False, "train.micro_batch_size": 8,
               "model.loss_chunk_tokens": 64, "model.ffn_hidden_size": 256, "model.activation_checkpointing": "full"}
ATTENTION_BOUND = {**BLOCK_BOUND, "model.ffn_hidden_size": 64, "model.num_heads": 12, "model.num_kv_heads": 4}
ALGORITHM_CASES = ("cp2-ring", "cp2-allgather", "cp2-ulysses", "cp4-ring", "cp4-allgather", "cp4-ulysses", "cp4-hybrid")
CASES.update({f"{name}-block": {**BLOCK_BOUND, **CASES[name]} for name in ALGORITHM_CASES})
CASES.update({f"{name}-attn": {**ATTENTION_BOUND, **CASES[name]} for name in ALGORITHM_CASES})
COMMON = {"train.steps": 3, "train.valid_interval": 0, "logging.console": False, "logging.wandb": False,
          "logging.interval": 1}


def case_config(overrides: dict[str, Any], run_dir: str) -> Config:
    """cpu-tiny with ``overrides`` (and a short run into ``run_dir`` without evaluation)."""
    values = {**COMMON, "logging.dir": run_dir, **overrides}
    return load_config(CONFIG, overrides=[f"{key}={value}" for key, value in values.items()])


def measure_step(state: ParallelState, config: Config) -> dict[str, Any]:
    """On every rank: build the run of ``config``, train one warm-up step, then count live tensor bytes through
    the next step. Returns the bytes at the start and the peaks of the forward-backward and of the rest of the
    step (gradient norm, clipping, optimizer), with the trainer's ``fsdp_reduce``."""
    trainer = Trainer(config, state)
    batches = iter(trainer.loader)
    trainer.train_step(next(batches))
    batch = next(batches)
    tracker = LiveTensorBytes()
    model, optimizer = trainer.model, trainer.optimizer
    tracker.track(p for p in model.parameters())
    tracker.track(p.grad for p in model.parameters())
    tracker.track(value for entry in optimizer.state.values() for value in entry.values())
    tracker.track(model.buffers())
    tracker.track(value for mb in batch for value in mb.values())
    start = tracker.current
    forward_backward = trainer.forward_backward

    def tracked_forward_backward(micro_batches: list) -> Any:
        tracker.new_phase("forward_backward")
        try:
            return forward_backward(micro_batches)
        finally:
            tracker.new_phase("optimizer")

    trainer.forward_backward = tracked_forward_backward  # type: ignore[method-assign]
    with tracker:
        trainer.train_step(batch)
    tracker.new_phase("end")
    return {"start": start, "peak": tracker.overall_peak, "forward_backward": tracker.peaks["forward_backward"],
            "optimizer": tracker.peaks["optimizer"], "fsdp_reduce": trainer.fsdp_reduce}


def layout(config: Config) -> tuple[int, int, int, int]:
    """``(tp, cp, dp, ulysses_size)`` of ``config`` (``run_with_parallel``'s shorthand)."""
    parallel = config.parallel
    subgroups = get_cp_algorithm(parallel.cp_algorithm).subgroups
    return parallel.tp, parallel.cp, parallel.dp or 1, parallel.ulysses_size if subgroups else 1


def planned(config: Config) -> dict[str, Any]:
    """The dry run's figures for the largest rank of ``config``'s layout."""
    tp, cp, dp, _ = layout(config)
    _, ranks, _, _ = memory_plan(config, tp * cp * dp)
    worst = max(ranks, key=lambda r: r.total_bytes)
    return {"planned": worst.total_bytes, "planned_state": worst.state_at_peak, "planned_phase": worst.phase,
            "planned_gathered": worst.gathered_bytes, "planned_activations": worst.activation_bytes}


def compare(world: SpawnedWorld, config: Config, name: str = "") -> dict[str, Any]:
    """``config`` measured on ``world`` (of its tp x cp x dp ranks) and planned: a record for ``emit``."""
    per_rank = world.run(run_with_parallel, layout(config), measure_step, config)
    worst = max(per_rank, key=lambda r: r["peak"])
    record: dict[str, Any] = {"case": name, "world": world.world, "measured": worst["peak"],
                              "measured_start": worst["start"], "measured_forward_backward": worst["forward_backward"],
                              "measured_optimizer": worst["optimizer"], "fsdp_reduce": worst["fsdp_reduce"],
                              **planned(config)}
    record["ratio"] = record["planned"] / record["measured"]
    return record


def run_case(name: str, world: SpawnedWorld, run_dir: str) -> dict[str, Any]:
    """The cpu-tiny case ``name`` (``CASES``) on ``world``."""
    record = compare(world, case_config(CASES[name], f"{run_dir}/{name}"), name)
    return {**record, "overrides": CASES[name]}


def check(names: list[str], threads: int = 2) -> list[dict[str, Any]]:
    """Measure and plan the cases ``names``, one spawned world per world size (reused across its cases)."""
    worlds: dict[int, SpawnedWorld] = {}
    records = []
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            for name in names:
                tp, cp, dp, _ = layout(case_config(CASES[name], run_dir))
                size = tp * cp * dp
                if size not in worlds:
                    worlds[size] = SpawnedWorld(size, threads=max(1, threads // size), timeout_s=1800)
                records.append(run_case(name, worlds[size], run_dir))
    finally:
        for world in worlds.values():
            world.close()
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=2, help="total threads, shared by the ranks")
    args = parser.parse_args(argv)
    records = check(args.cases, args.threads)
    mib = lambda x: "" if x is None else f"{x / MIB:.2f}"  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("case", "case", text), ("world", "ranks", text), ("planned", "planned MiB", mib),
                   ("measured", "measured MiB", mib), ("ratio", "planned/measured", lambda x: f"{x:.3f}"),
                   ("planned_phase", "peak at", text), ("planned_state", "state", mib),
                   ("measured_start", "at start", mib),
                   ("planned_gathered", "gathered", mib), ("planned_activations", "activations", mib),
                   ("measured_forward_backward", "fwd+bwd peak", mib), ("measured_optimizer", "optim peak", mib)])
    return records


if __name__ == "__main__":
    main()
