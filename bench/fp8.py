"""FP8 linears against bf16 on one GPU: the trainer's run of the 1B config at 16,384 tokens per step, compiled,
with ``model.fp8`` none (bf16), tensorwise and rowwise (``parallel/tp/fp8.py``); ``tensorwise-fast`` and
``rowwise-fast`` (not run by default) also accumulate the backward's FP8 GEMMs fast (``model.fp8_fast_accum=all``).

    python -m bench.fp8                                   # GPU: 100 steps per variant (about 80 s each on an H200)
    python -m bench.fp8 --steps 40 --variants none tensorwise
    python -m bench.fp8 --seq 8192 --set model.hidden_size=4096 ...  # another model shape (--set as train.py's)
    python -m bench.fp8 --tiny                            # CPU: a tiny model, a few eager steps, emulated FP8

Each variant is one ``Trainer`` run in a world of one process (nccl on CUDA, gloo on CPU) on the embedded corpus,
the same data and seed for all: ``launch/configs/gpt-1b-128k-cp8.yaml`` at cp 1 without FSDP (``--fsdp``: with it),
``data.seq_len`` ``--seq`` (16,384), one sample per step, bf16 autocast, ``train.compile`` (``--eager``: off),
logging every ``--interval`` steps. Per variant: the step time (median of the logged intervals after the first,
which holds the compilation), tokens/s, ``mfu`` (at the bf16 peak), ``mfu_fp8_peak`` (the FP8 linears at the FP8
peak; ``cp_train/metrics/throughput.py``), the loss at the last step and its relative difference from bf16's,
tokens/s over bf16's and the peak memory; beside them the planner's prediction for the same run (the one every
run makes of itself, ``cp_train/perf/run_check.py``: this config, the corpus's documents, ``--hardware`` or the
GPU's own profile): its tokens/s, its speedup over bf16's, the measured step time over the planned one and the dry
run's peak memory.
JSON lines, then a table (``bench.common.emit``).

On CUDA each variant trains in its own Python process (``--processes each``, the default there): on an H200 with
torch 2.11 a second compiled run in the process of the first died with a segfault (exit 139) as it started,
where the same variant in a fresh process ran. A variant that fails is reported and the others go on.

The issue's bar on an H100/H200: FP8 within 1% of bf16's loss at step 100, tensorwise at least 1.2x bf16's tokens/s.
torchao must be installed where it runs (``pip install -e ".[fp8]"``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/fp8.py` from anywhere

import torch  # noqa: E402

from bench.common import emit, fp8_variant, progress  # noqa: E402
from cp_train.config.schema import Config, ConfigError  # noqa: E402
from cp_train.config.sources import build_config, flatten, parse_override, read_yaml  # noqa: E402
from cp_train.config.validate import validate  # noqa: E402
from cp_train.metrics.writers import METRICS_FILE  # noqa: E402
from cp_train.parallel.mesh.state import parallel_context, world_of_one  # noqa: E402
from cp_train.parallel.tp.fp8 import fp8_unavailable  # noqa: E402
from cp_train.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "launch" / "configs" / "gpt-1b-128k-cp8.yaml"
VARIANTS = ("none", "tensorwise", "rowwise", "tensorwise-fast", "rowwise-fast")  # -fast: model.fp8_fast_accum=all
DEFAULT_VARIANTS = VARIANTS[:3]

TINY_MODEL = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
              "model.ffn_hidden_size": 128, "model.max_position_embeddings": 128}


def run_config(args: argparse.Namespace, variant: str, run_dir: Path) -> Config:
    """The 1B config (or ``--tiny``'s) for one variant, in a world of one."""
    recipe, fast_accum = fp8_variant(variant)
    values = flatten(read_yaml(CONFIG), str(CONFIG))
    values.update({
        "model.fp8": recipe, "parallel.cp": 1, "parallel.fsdp": args.fsdp, "parallel.backend": None,
        "data.seq_len": args.seq, "train.micro_batch_size": 1, "train.global_batch_size": 1,
        "train.steps": args.steps, "schedule.warmup_steps": max(1, args.steps // 10), "train.valid_interval": 0,
        "train.compile": not args.eager, "train.dtype": "auto", "checkpoint.save": None, "checkpoint.interval": 0,
        "logging.dir": str(run_dir), "logging.interval": args.interval, "logging.wandb": False,
        "logging.console": False, "logging.hardware_profile": args.hardware})
    if fast_accum != "output":  # set only where it differs: under bf16 it would be noted as doing nothing
        values["model.fp8_fast_accum"] = fast_accum
    if args.tiny:
        values.update(TINY_MODEL)
    return build_config([("bench.fp8", values), ("--set", dict(parse_override(o) for o in args.overrides))])


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """Train one variant; its record (see the module docstring)."""
    run_dir = Path(args.out) / variant
    config = run_config(args, variant, run_dir)
    torch._dynamo.reset()  # each variant compiles its own graphs
    with parallel_context(backend="nccl" if torch.cuda.is_available() else "gloo") as state:
        trainer = Trainer(config, state)
        result = trainer.train()
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    intervals = [r for r in records if r.get("kind") == "train"]
    timed = intervals[1:] or intervals  # the first interval holds the compilation
    setup = next(r for r in records if r.get("kind") == "setup")
    last = max(result.losses)
    return {"variant": variant, "steps": last, "seq_len": args.seq,
            "compiled": not args.eager, "fp8_linears": setup.get("fp8_linears", 0),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed),
            "mfu_fp8_peak": statistics.median(r.get("mfu_fp8_peak", r["mfu"]) for r in timed),
            "loss": result.losses[last], "peak_memory_gib": max(r["peak_memory_gib"] for r in intervals),
            "planned": trainer.prediction}


def run_in_process(args: argparse.Namespace, variant: str) -> dict[str, Any] | None:
    """``variant`` trained by ``python -m bench.fp8`` in a fresh process with the same flags; its record, or None
    (and one line saying so) when that process fails."""
    record_file = Path(args.out) / f"{variant}.record.json"
    record_file.unlink(missing_ok=True)
    flags = ["--steps", str(args.steps), "--seq", str(args.seq), "--interval", str(args.interval), "--out", args.out,
             "--processes", "one", "--record", str(record_file), "--variants", variant]
    flags += ["--eager"] * args.eager + ["--fsdp"] * args.fsdp + ["--tiny"] * args.tiny
    flags += ["--hardware", args.hardware] if args.hardware else []
    flags += [item for override in args.overrides for item in ("--set", override)]
    code = subprocess.run([sys.executable, "-m", "bench.fp8", *flags], cwd=ROOT).returncode
    if code != 0 or not record_file.is_file():
        print(f"bench.fp8 {variant}: its process failed with exit {code} (its output above); the others go on",
              flush=True)
        return None
    return json.loads(record_file.read_text())


def read_baseline(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """The bf16 record ``--baseline`` names (a child run's ``none.record.json``); one line when it is not one, or
    when its run took other steps or tokens per step than this one."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        sys.exit(f"bench.fp8 --baseline {path}: cannot read a run's record ({error}); run --variants none first")
    if not isinstance(record, dict) or record.get("variant") != "none":
        sys.exit(f"bench.fp8 --baseline {path}: not a bf16 run's record (variant none); give OUT/none.record.json")
    if (record.get("steps"), record.get("seq_len")) != (args.steps, args.seq):
        sys.exit(f"bench.fp8 --baseline {path}: its run took {record.get('steps')} steps of {record.get('seq_len')} "
                 f"tokens and this one {args.steps} of {args.seq}: give the same --steps and --seq")
    return record


def check_variants(args: argparse.Namespace) -> str | None:
    """Why one of the variants cannot run here (torchao missing, a GPU without FP8, a shape FP8 refuses), as one
    line, or None: checked for all of them before the first (bf16's) run."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for variant in args.variants:
        problem = fp8_unavailable(fp8_variant(variant)[0], device)
        if problem is None:
            try:
                validate(run_config(args, variant, Path(args.out) / variant), 1)
            except ConfigError as error:
                problem = str(error)
        if problem is not None:
            return f"bench.fp8 {variant}: {problem}"
    return None


def compare(records: list[dict[str, Any]]) -> None:
    """Each record's loss and tokens/s against the bf16 run's (when there is one), and against the planner's."""
    base = next((r for r in records if r["variant"] == "none"), None)
    for record in records:
        record["loss_vs_bf16"] = record["loss"] / base["loss"] - 1 if base else None
        record["speedup_vs_bf16"] = record["tokens_per_s"] / base["tokens_per_s"] if base else None
        planned = record.pop("planned") or {}
        record["planned_tokens_per_s"] = planned.get("tokens_per_s_per_device")
        record["measured_vs_planned"] = (record["step_time_s"] / planned["step_time_s"]) if planned else None
        record["planned_memory_gib"] = planned.get("memory_gib")  # the dry run's, the reserve left out
    planned_base = base["planned_tokens_per_s"] if base else None
    for record in records:
        record["planned_speedup_vs_bf16"] = (record["planned_tokens_per_s"] / planned_base
                                             if planned_base and record["planned_tokens_per_s"] else None)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                        help="model.fp8 of each run (-fast: model.fp8_fast_accum=all, the backward's GEMMs too)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=16384, help="tokens per step (one sample)")
    parser.add_argument("--interval", type=int, default=10, help="steps per logged interval")
    parser.add_argument("--eager", action="store_true", help="no train.compile")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over the one rank (FP8 all-gathers, tensorwise)")
    parser.add_argument("--out", default="runs/bench-fp8", help="the runs' directories")
    parser.add_argument("--hardware", default=None, help="the planner's profile for the planned columns (default: "
                                                          "the GPU's own; none on CPU)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, 3 eager steps of 128 tokens (CPU smoke)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override after the bench's own (e.g. model.num_layers=8)")
    parser.add_argument("--processes", choices=("auto", "one", "each"), default="auto",
                        help="each variant in its own process (auto: on CUDA) or all in this one")
    parser.add_argument("--baseline", default=None, help="a bf16 run's record (OUT/none.record.json of an earlier "
                                                          "run with the same flags) to compare with, not run again")
    parser.add_argument("--record", default=None, help=argparse.SUPPRESS)  # the file a child writes its record to
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.seq, args.interval, args.eager = 3, 128, 1, True
    problem = check_variants(args)
    if problem is not None:
        sys.exit(problem)  # one line, exit 1
    baseline = read_baseline(args.baseline, args) if args.baseline and "none" not in args.variants else None
    each = args.processes == "each" or (args.processes == "auto" and torch.cuda.is_available())
    if each:
        records = [r for r in (run_in_process(args, variant) for variant in args.variants) if r is not None]
    else:
        with world_of_one():
            records = [progress(run_variant(args, variant)) for variant in args.variants]
    if args.record:
        Path(args.record).write_text(json.dumps(records[0]))
        return records
    if baseline is not None:
        records.insert(0, baseline)
    compare(records)
    percent = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    times = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    emit(records, [("variant", "model.fp8", str), ("step_time_s", "step s", lambda v: f"{v:.3g}"),
                   ("tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"), ("mfu", "MFU (bf16 peak)", percent),
                   ("mfu_fp8_peak", "MFU (fp8 peak)", percent), ("loss", f"loss@{args.steps}", lambda v: f"{v:.4f}"),
                   ("loss_vs_bf16", "vs bf16", lambda v: "-" if v is None else f"{v:+.2%}"),
                   ("speedup_vs_bf16", "speedup", times), ("peak_memory_gib", "GiB", lambda v: f"{v:.1f}"),
                   ("planned_memory_gib", "planned GiB", lambda v: "-" if v is None else f"{v:.1f}"),
                   ("planned_tokens_per_s", "planned tokens/s", lambda v: "-" if v is None else f"{v:,.0f}"),
                   ("planned_speedup_vs_bf16", "planned speedup", times),
                   ("measured_vs_planned", "step measured/planned", times)])
    return records


if __name__ == "__main__":
    main()
