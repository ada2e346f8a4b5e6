"""The planner against every measured run (``cp_train/perf/inputs/measured_runs.yaml``): each run predicted in its own
unit, the error, and the ranges' out-of-sample check per regime.

    python bench/planner_published.py            # JSON lines, then the tables
    python bench/planner_published.py --markdown # the tables as docs/planner.md shows them
    python bench/planner_published.py --write    # also record the errors the planner's ranges read

Each prediction uses the run's hardware profile, layout and attention kernel (``run_config``); settings a source
leaves out are the planner's choice: activation checkpointing not stated is the fastest mode that fits, a CP
algorithm not stated is the source framework's default (torchtitan's all-gather, Transformer Engine's ring), the
layout zigzag. Nothing is fitted to any run. The check of the ranges (``cp_train/perf/ranges.py``) is leave-one-out:
each run against the range made from the others; ``width`` is the range made from all (high / low).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/planner_published.py` from anywhere

import yaml  # noqa: E402

from cp_train.config.schema import Config  # noqa: E402
from cp_train.memory.dry_run import reserve_gib  # noqa: E402
from cp_train.perf.inputs.hardware import load_hardware  # noqa: E402
from cp_train.perf.inputs.presets import parameter_count  # noqa: E402
from cp_train.perf.inputs.runs import MeasuredRun, measured_runs  # noqa: E402
from cp_train.perf.predict import Prediction, predict  # noqa: E402
from cp_train.perf.ranges import ERRORS_FILE, ErrorBand, Regime, band, regime_of  # noqa: E402
from cp_train.perf.rates import DeviceRates  # noqa: E402
from cp_train.perf.time_model import attention_seconds  # noqa: E402
from cp_train.perf.workload import build_workload  # noqa: E402

UNITS = {"tokens_per_s_per_gpu": "tok/s/GPU", "tflops_per_gpu": "TFLOP/s/GPU", "attention_fraction_of_ideal":
         "of ideal"}


@dataclass(frozen=True)
class Comparison:
    run: MeasuredRun
    predicted: float
    measured: float
    unit: str
    prediction: Prediction | None  # None for attention-only runs

    @property
    def error(self) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predicted / self.measured - 1


def run_config(run: MeasuredRun, checkpointing: str) -> Config:
    """The trainer config of ``run``'s layout (CUDA, bf16 compute)."""
    config = Config()
    config.model = run.model_config()
    config.model.fp8 = (run.fp8_recipe or "tensorwise") if run.precision == "fp8" else "none"
    config.model.activation_checkpointing, config.model.mlp_chunks = checkpointing, run.mlp_chunks
    if run.loss_chunk_tokens is not None:
        config.model.loss_chunk_tokens = run.loss_chunk_tokens
    config.data.seq_len, config.data.document_mask = run.seq_len, run.document_lengths is not None
    p = config.parallel
    p.tp, p.cp, p.dp, p.fsdp = run.tp, run.cp, run.dp, run.fsdp
    p.cp_algorithm = run.cp_algorithm or ("allgather" if "torchtitan" in run.source else "ring")
    p.cp_layout = run.cp_layout or "zigzag"
    config.train.micro_batch_size = run.micro_batch or 1
    config.train.global_batch_size = run.global_batch or run.dp * config.train.micro_batch_size
    config.train.dtype = "bf16"
    config.train.compile = run.compiled is not False  # None: Transformer Engine's fused kernels
    config.logging.wandb = False
    return config


def _attention_only(run: MeasuredRun, rates: DeviceRates) -> float:
    """Measured / ideal of the ring's forward + backward: ideal is the whole causal attention split evenly over
    the GPUs at one GPU's rate on its own tokens (``cp`` times one GPU's kernel on ``seq/cp`` tokens)."""
    config = run_config(run, "none")
    forward, backward, exposed_f, exposed_b = attention_seconds(build_workload(config, run.layout_gpus, 2), rates)
    single = copy.deepcopy(config)
    single.parallel.cp, single.data.seq_len = 1, run.seq_len // run.cp
    ideal_f, ideal_b, _, _ = attention_seconds(build_workload(single, 1, 2), rates)
    return run.cp * (ideal_f + ideal_b) / (forward + backward + exposed_f + exposed_b)


def compare(run: MeasuredRun) -> Comparison:
    """``run`` predicted in its own unit (see the module docstring)."""
    hardware = load_hardware(run.hardware)
    rates = DeviceRates(hardware, run.precision, run.attention_kernel)
    measured, unit = run.measured
    if run.attention_only:
        return Comparison(run, _attention_only(run, rates), measured, unit, None)
    modes = ("none", "selective", "full") if run.activation_checkpointing == "unknown" else (
        run.activation_checkpointing,)
    # Transformer Engine's FP8 memory (FP8 casts kept, beside Megatron's distributed optimizer, which the plan does
    # not model either) planned as bf16's, as the ranges were made
    keeps = "bf16" if run.compiled is None else None
    predictions = [predict(run_config(run, mode), run.layout_gpus, rates, hardware.peak_tflops("bf16"),
                           hardware.hbm_gib, reserve_gib(hardware.hbm_gib), run.document_lengths, keeps)
                   for mode in modes]
    best = max([p for p in predictions if p.fits] or predictions, key=lambda p: p.tokens_per_s_per_gpu)
    predicted = (best.tokens_per_s_per_gpu if unit == "tokens_per_s_per_gpu"
                 else best.tflops_per_gpu(run.flop_convention or "causal_full"))
    return Comparison(run, predicted, measured, unit, best)


def leave_one_out(errors: dict[str, tuple[Regime, float]]) -> list[tuple[str, float, ErrorBand]]:
    """``(key, error, band made without it)`` for every run: the out-of-sample check of the ranges."""
    return [(key, error, band(regime, errors, leave_out=key)) for key, (regime, error) in errors.items()]


def run_regime(run: MeasuredRun) -> Regime:
    """The regime of ``run`` (``ranges.regime_of``; attention-only runs: their own)."""
    if run.attention_only:
        return ("attention",)
    return regime_of(parameter_count(run.model_config()), run.seq_len, run.precision, run.gpus,
                     load_hardware(run.hardware).gpus_per_node)


def write_errors(records: list[dict]) -> None:
    """Record each run's regime and error for ``cp_train/perf/ranges.py``."""
    rows = [{"key": r["key"], "regime": list(r["regime"]), "error": round(r["error"], 5)} for r in records]
    header = ("# written by `python bench/planner_published.py --write`: each measured run's regime and the planner's\n"
              "# error (predicted / measured - 1); cp_train/perf/ranges.py reads it\n")
    ERRORS_FILE.write_text(header + yaml.safe_dump({"runs": rows}, sort_keys=False, default_flow_style=None),
                           encoding="utf-8")


def _print_table(header: tuple[str, ...], lines: list[tuple[str, ...]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        print("\n".join("| " + " | ".join(line) + " |" for line in lines))
        return
    rows = [header, *lines]
    widths = [max(len(line[i]) for line in rows) for i in range(len(header))]
    print("\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in rows))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--write", action="store_true", help=f"record the errors in {ERRORS_FILE.name}")
    args = parser.parse_args(argv)
    records = []
    for run in measured_runs():
        result = compare(run)
        records.append({"key": run.key, "model": run.model, "hardware": run.hardware, "gpus": run.gpus,
                        "seq_len": run.seq_len, "precision": run.precision, "fp8_recipe": run.fp8_recipe,
                        "unit": result.unit,
                        "layout": f"tp{run.tp} cp{run.cp} dp{run.dp}" + (" fsdp" if run.fsdp else ""),
                        "measured": result.measured, "predicted": result.predicted, "error": result.error,
                        "regime": run_regime(run)})
        print(json.dumps({**records[-1], "regime": "/".join(records[-1]["regime"])}))
    errors = {r["key"]: (r["regime"], r["error"]) for r in records}
    outside = {key: not made.contains(error) for key, error, made in leave_one_out(errors)}
    made_without = {key: made for key, _, made in leave_one_out(errors)}
    bands = {r["key"]: band(r["regime"], errors) for r in records}
    regimes = {made.regime: made for made in bands.values()}
    classes: dict[str, list[str]] = {}
    for r in records:
        for name in r["regime"]:
            classes.setdefault(name, []).append(r["key"])
    summary = {"runs": len(records), "mean_absolute_error": sum(abs(r["error"]) for r in records) / len(records),
               "inside_out_of_sample": sum(not miss for miss in outside.values()),
               "regimes": {"/".join(regime): {"runs": len(made.runs), "low": made.low, "high": made.high,
                                              "width": made.width,
                                              "inside": sum(not outside[k] for k in made.runs)}
                           for regime, made in regimes.items()},
               "classes": {name: {"runs": len(keys), "inside": sum(not outside[k] for k in keys),
                                  "widest": max(bands[k].width for k in keys)} for name, keys in classes.items()}}
    print(json.dumps(summary))
    _print_table(("run", "model", "GPUs", "seq", "layout", "precision", "measured", "predicted", "error",
                  "range without it", "inside"),
                 [(r["key"], r["model"], str(r["gpus"]), f"{r['seq_len'] // 1024}k", r["layout"],
                   " ".join(filter(None, (r["precision"], r["fp8_recipe"]))),
                   f"{r['measured']:,.3g} {UNITS[r['unit']]}", f"{r['predicted']:,.3g}", f"{r['error']:+.1%}",
                   f"{made_without[r['key']].low:+.1%} .. {made_without[r['key']].high:+.1%}",
                   "NO" if outside[r["key"]] else "yes") for r in records], args.markdown)
    print()
    _print_table(("regime (runs it is made from)", "runs", "inside the range made without them", "range",
                  "high / low"),
                 [(name, str(v["runs"]), str(v["inside"]), f"{v['low']:+.1%} .. {v['high']:+.1%}", f"{v['width']:.3f}")
                  for name, v in summary["regimes"].items()], args.markdown)
    print()
    _print_table(("class", "runs", "inside the range made without them", "widest range printed for them"),
                 [(name, str(v["runs"]), f"{v['inside']} ({v['inside'] / v['runs']:.0%})", f"{v['widest']:.3f}")
                  for name, v in sorted(summary["classes"].items())], args.markdown)
    print(f"\n{summary['inside_out_of_sample']} of {len(records)} runs inside the range made without them "
          f"({summary['inside_out_of_sample'] / len(records):.1%}); widest range "
          f"{max(r['width'] for r in summary['regimes'].values()):.3f}; mean absolute error "
          f"{summary['mean_absolute_error']:.1%}")
    if args.write:
        write_errors(records)
    return summary


if __name__ == "__main__":
    main()
