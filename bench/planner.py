"""The planner (``cp_train.plan``) against the real trainer on CPU: predicted and measured step time and peak memory.

    python -m bench.planner [--hardware cpu.yaml] [--cases cp2-ring cp4-ulysses ...] [--steps 8 --warmup 3]
    python -m bench.planner --count-ops [--cases ...]   # a step's aten ops against host_ops.step_ops (which leaves
                                                        # the CP attention op's own out: calibrated whole)

Without ``--hardware`` the machine is calibrated first (``cp-train-plan --calibrate``, written to ``--save`` or a
temporary file). Each case is ``launch/configs/cpu-tiny.yaml`` with overrides (``CASES``), one document per sample
(``data.document_mask`` off: the planner models one causal document per sample). The planner predicts it on the
profile (``predict``: the time model and the dry run's memory of its largest rank); then the real ``Trainer`` runs
it in spawned gloo ranks (world = tp x cp, a fresh world per case; threads per rank as the trainer's spawned
worlds set them: the cores shared evenly, at least one) with glibc's defaults (the trainer keeps freed memory). A
step's time is the slowest rank's ``train_step`` (data, forward and backward of every micro-batch, gradient sync,
clipping, AdamW), the figure the median over ``--steps`` steps after ``--warmup``; ``best`` is the fastest step
(the median on a quiet machine lies near it; ``vs best``: the prediction's error against it). Peak memory: one
more step under ``bench.tensor_bytes`` (live tensor bytes, the largest rank's peak). Errors are predicted /
measured - 1. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/planner.py` from anywhere

from bench.common import emit, glibc_malloc  # noqa: E402
from bench.tensor_bytes import LiveTensorBytes  # noqa: E402
from cp_train.config.schema import Config  # noqa: E402
from cp_train.config.sources import load_config  # noqa: E402
from cp_train.memory.dry_run import GIB  # noqa: E402
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402
from cp_train.plan.inputs.hardware import Hardware, load_hardware  # noqa: E402
from cp_train.plan.predict import Prediction, predict  # noqa: E402
from cp_train.plan.rates import DeviceRates  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "cpu-tiny.yaml"
MIB = 2.0**20
COMMON = {"data.document_mask": False, "train.eval_interval": 0, "train.steps": 1000, "logging.console": False,
          "logging.wandb": False, "logging.interval": 1000}
ULYSSES4 = {"model.num_heads": 8}  # cpu-tiny's 6 query heads are not divisible by cp 4: 8 heads of 24
FULL, FSDP = {"model.activation_checkpointing": "full"}, {"parallel.fsdp": True}
# 4x wider than cpu-tiny (hidden 768, 24 heads of 32, 8 kv heads, MLP 2048) at seq 4096, one sample per micro-batch
WIDE = {"model.hidden_size": 768, "model.num_heads": 24, "model.num_kv_heads": 8, "model.ffn_hidden_size": 2048,
        "data.seq_len": 4096, "model.max_position_embeddings": 4096, "train.micro_batch_size": 1,
        "train.global_batch_size": 2}
CASES: dict[str, dict[str, Any]] = {
    "cp1": {"parallel.cp": 1},
    "cp2-ring": {}, "cp2-allgather": {"parallel.cp_algorithm": "allgather"},
    "cp2-ulysses": {"parallel.cp_algorithm": "ulysses"},
    "cp4-ring": {"parallel.cp": 4}, "cp4-allgather": {"parallel.cp": 4, "parallel.cp_algorithm": "allgather"},
    "cp4-ulysses": {"parallel.cp": 4, "parallel.cp_algorithm": "ulysses", **ULYSSES4},
    "tp2-cp2": {"parallel.tp": 2},
    "cp1-full": {"parallel.cp": 1, **FULL}, "cp2-ring-fsdp": FSDP, "cp2-ring-full": FULL,
    "cp2-ring-fsdp-full": {**FSDP, **FULL}, "cp2-ulysses-fsdp-full": {"parallel.cp_algorithm": "ulysses", **FSDP,
                                                                      **FULL},
    "tp2-cp2-fsdp": {"parallel.tp": 2, **FSDP}, "tp2-cp2-full": {"parallel.tp": 2, **FULL},
    "cp4-ring-fsdp-full": {"parallel.cp": 4, **FSDP, **FULL},
    "wide-cp2-ring": {**WIDE}, "wide-cp4-ring": {**WIDE, "parallel.cp": 4},
    "wide-cp2-ulysses": {**WIDE, "parallel.cp_algorithm": "ulysses"},
}
WIDE_STEPS = (1, 3)  # (warm-up, timed) steps of the wide cases


def case_config(name: str, run_dir: str) -> Config:
    """cpu-tiny with the case's overrides, running into ``run_dir``."""
    values = {**COMMON, "logging.dir": f"{run_dir}/{name}", **CASES[name]}
    return load_config(CONFIG, overrides=[f"{key}={value}" for key, value in values.items()])


def predicted(config: Config, hardware: Hardware) -> Prediction:
    """The planner's prediction of ``config`` on ``hardware`` (world tp x cp)."""
    world = config.parallel.tp * config.parallel.cp * (config.parallel.dp or 1)
    return predict(copy.deepcopy(config), world, DeviceRates(hardware), hardware.peak_tflops(hardware.compute_dtype),
                   hardware.hbm_gib, 0.0)


def measure(state: ParallelState, config: Config, warmup: int, steps: int) -> dict[str, Any]:
    """On every rank: build the run, time ``warmup + steps`` train steps, then count live tensor bytes through one
    more (``bench/dry_run_check.py``'s count: from the state alive before it). Returns the timed steps' seconds and
    the peak bytes."""
    from cp_train.trainer import Trainer

    trainer = Trainer(config, state)
    batches = iter(trainer.loader)
    seconds = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        trainer.train_step(next(batches))
        seconds.append(time.perf_counter() - start)
    batch = next(batches)
    tracker = LiveTensorBytes()
    model, optimizer = trainer.model, trainer.optimizer
    tracker.track(model.parameters())
    tracker.track(p.grad for p in model.parameters())
    tracker.track(value for entry in optimizer.state.values() for value in entry.values())
    tracker.track(model.buffers())
    tracker.track(value for mb in batch for value in mb.values())
    with tracker:
        trainer.train_step(batch)
    return {"seconds": seconds[warmup:], "peak": tracker.overall_peak}


def count_ops(state: ParallelState, config: Config) -> float:
    """On every rank: the aten and c10d ops of one ``train_step`` after a warm-up step (the attention op's body
    included), as ``host_ops.step_ops`` counts them."""
    from cp_train.plan.calibration.calibrate import OpCounter
    from cp_train.trainer import Trainer

    trainer = Trainer(config, state)
    batches = iter(trainer.loader)
    trainer.train_step(next(batches))
    with OpCounter() as counter:
        trainer.train_step(next(batches))
    return float(counter.ops)


def _world_of(config: Config) -> tuple[int, int, int]:
    return config.parallel.tp, config.parallel.cp, config.parallel.dp or 1


def run(names: list[str], hardware: Hardware, warmup: int, steps: int, ops: bool = False) -> list[dict[str, Any]]:
    """Predict and measure each case, each in a fresh spawned world (as a run starts: a world reused across cases
    ran later cases up to 13% slower)."""
    records = []
    with tempfile.TemporaryDirectory() as run_dir:
        for name in names:
            config = case_config(name, run_dir)
            layout = _world_of(config)
            size = layout[0] * layout[1] * layout[2]
            prediction = predicted(config, hardware)
            record: dict[str, Any] = {"case": name, "ranks": size, "overrides": CASES[name],
                                      "predicted_s": prediction.step_time_s,
                                      "breakdown_s": prediction.record()["breakdown_s"],
                                      "predicted_mib": prediction.memory_gib["total"] * GIB / MIB}
            with glibc_malloc(live_memory=False):
                world = SpawnedWorld(size, threads=max(1, hardware.cpu.cores // size) if hardware.cpu else None,
                                     timeout_s=1800)
            with world:
                if ops:
                    from cp_train.plan.host_ops import step_ops
                    from cp_train.plan.workload import build_workload

                    counted = world.run(run_with_parallel, layout, count_ops, config)
                    planned = copy.deepcopy(config)
                    planned.parallel.dp = layout[2]
                    planned.model.vocab_size = planned.model.vocab_size or 8192
                    record.update(counted_ops=max(counted), planned_ops=step_ops(build_workload(planned, size, 4)))
                    record["ops_error"] = record["planned_ops"] / record["counted_ops"] - 1
                else:
                    wide = name.startswith("wide")
                    runs = world.run(run_with_parallel, layout, measure, config,
                                     *(WIDE_STEPS if wide else (warmup, steps)))
                    per_step = [max(r["seconds"][i] for r in runs) for i in range(len(runs[0]["seconds"]))]
                    record.update(measured_s=statistics.median(per_step), best_s=min(per_step),
                                  measured_mib=max(r["peak"] for r in runs) / MIB)
                    record["time_error"] = record["predicted_s"] / record["measured_s"] - 1
                    record["best_error"] = record["predicted_s"] / record["best_s"] - 1
                    record["memory_error"] = record["predicted_mib"] / record["measured_mib"] - 1
            print(f"# {name}: done", file=sys.stderr, flush=True)
            records.append(record)
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default=None, help="a calibrated profile (default: calibrate first)")
    parser.add_argument("--save", default=None, help="where the calibration writes its profile (default: a temp file)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=8, help="timed steps (the wide cases: 3)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (the wide cases: 1)")
    parser.add_argument("--count-ops", action="store_true", help="count each case's ops instead of timing it")
    args = parser.parse_args(argv)
    if args.hardware is None:
        from cp_train.plan.calibration.calibrate import write_profile

        args.hardware = args.save or tempfile.mkstemp(suffix=".yaml")[1]
        with glibc_malloc(live_memory=False):  # its ranks keep freed memory as the trainer's do
            write_profile(args.hardware, log=lambda line: print(f"# {line}", file=sys.stderr, flush=True))
    hardware = load_hardware(args.hardware)
    records = run(args.cases, hardware, args.warmup, args.steps, args.count_ops)
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    pct = lambda x: "" if x is None else f"{x:+.1%}"  # noqa: E731
    if args.count_ops:
        columns = [("case", "case", text), ("ranks", "ranks", text),
                   ("planned_ops", "planned ops (no CP op's own)", "{:.0f}".format),
                   ("counted_ops", "counted ops", "{:.0f}".format), ("ops_error", "error", pct)]
    else:
        ms = lambda x: "" if x is None else f"{1000 * x:.0f}"  # noqa: E731
        mib = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
        columns = [("case", "case", text), ("ranks", "ranks", text), ("predicted_s", "predicted ms", ms),
                   ("measured_s", "measured ms", ms), ("time_error", "time error", pct), ("best_s", "best ms", ms),
                   ("best_error", "vs best", pct),
                   ("predicted_mib", "predicted MiB", mib), ("measured_mib", "measured MiB", mib),
                   ("memory_error", "memory error", pct)]
    emit(records, columns)
    return records


if __name__ == "__main__":
    main()
