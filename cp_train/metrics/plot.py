"""Loss and throughput curves of a run, drawn from its ``metrics.jsonl``.

    python -m cp_train.cli.plot RUN_DIR [--out DIR]

Writes ``loss.png`` (training loss, and validation loss when the run evaluated) and
``throughput.png`` (tokens/s per device, TFLOP/s per device, MFU) to ``--out`` (default: RUN_DIR).
Needs matplotlib (``pip install -e ".[dev]"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cp_train.errors import InputError
from cp_train.metrics.sinks import METRICS_FILE


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``RUN_DIR/metrics.jsonl``, in order (a resumed run appends to the same file)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise InputError(f"{path} is missing: pass a run directory (logging.dir, --run-dir) holding {METRICS_FILE}")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed while writing leaves a partial last line
            continue
    return records


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    points = {r["step"]: r[key] for r in records if r.get("kind", "train") == kind and r.get(key) is not None}
    steps = sorted(points)  # a resumed run re-logs steps: the latest value wins
    return steps, [points[s] for s in steps]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw the PNGs of ``run_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(run_dir)
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(run_dir).resolve().name
    written = []

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(*_series(records, "train", "loss"), label="train")
    eval_steps, eval_losses = _series(records, "eval", "loss")
    if eval_steps:
        axis.plot(eval_steps, eval_losses, "o-", label="validation")
    axis.set(xlabel="step", ylabel="loss", title=f"{name}: loss")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    written.append(out / "loss.png")
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    panels = (("tokens_per_s_per_device", "tokens/s per device"), ("tflops_per_device", "TFLOP/s per device"),
              ("mfu", "MFU"))
    figure, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    for axis, (key, label) in zip(axes, panels, strict=True):
        axis.plot(*_series(records, "train", key))
        axis.set(xlabel="step", title=label)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{name}: throughput")
    figure.tight_layout()
    written.append(out / "throughput.png")
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)
    return written
