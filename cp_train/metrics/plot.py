"""Loss, throughput and memory curves of one or several runs, drawn from their ``metrics.jsonl``.

    python -m cp_train.cli.plot RUN_DIR [RUN_DIR ...] [--out DIR]

Writes ``loss.png`` (training loss, and validation loss when a run evaluated), ``throughput.png`` (tokens/s
per device, TFLOP/s per device, MFU with attention under the mask (``mfu``) and in full (``mfu_dense``,
dashed)) and ``memory.png`` (peak memory, the max over ranks, in GiB and as a percentage of the device) to
``--out`` (default: the first RUN_DIR). Several runs (cp 2 vs 4 vs 8, say) share each chart, one line per run
named by its directory; a layout change on resume (an ``event`` record) is a dotted vertical line.
Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cp_train.errors import InputError
from cp_train.metrics.writers import METRICS_FILE


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


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PANELS = {
    "throughput": (("tokens_per_s_per_device", "tokens/s per device"), ("tflops_per_device", "TFLOP/s per device"),
                   ("mfu", "MFU (dashed: mfu_dense)")),
    "memory": (("peak_memory_max_gib", "peak memory, max over ranks (GiB)"),
               ("peak_memory_pct", "peak memory (% of the device)")),
}


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Draw the PNGs of ``run_dirs`` (one line per run); returns their paths."""
    plt = _pyplot()
    runs = {Path(d).resolve().name: read_records(d) for d in run_dirs}
    out = Path(out_dir or run_dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    title = ", ".join(runs)
    written = []

    def mark_events(axis: Any, records: list[dict[str, Any]], color: Any) -> None:
        for event in (r for r in records if r.get("kind") == "event"):
            axis.axvline(event["step"], color=color, linestyle=":", alpha=0.8)

    def finish(figure: Any, name: str, what: str) -> None:
        figure.suptitle(f"{title}: {what}")
        figure.tight_layout()
        written.append(out / name)
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, records in runs.items():
        line = axis.plot(*_series(records, "train", "loss"), label=f"{name} train")[0]
        eval_steps, eval_losses = _series(records, "eval", "loss")
        if eval_steps:
            axis.plot(eval_steps, eval_losses, "o--", color=line.get_color(), label=f"{name} validation")
        mark_events(axis, records, line.get_color())
    axis.set(xlabel="step", ylabel="loss")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    finish(figure, "loss.png", "loss")

    for chart, panels in PANELS.items():
        figure, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
        for axis, (key, label) in zip(axes, panels, strict=True):
            for name, records in runs.items():
                line = axis.plot(*_series(records, "train", key), label=name)[0]
                if key == "mfu":
                    axis.plot(*_series(records, "train", "mfu_dense"), "--", color=line.get_color())
                mark_events(axis, records, line.get_color())
            axis.set(xlabel="step", title=label)
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize="small")
        finish(figure, f"{chart}.png", chart)
    return written


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw the PNGs of one run (``plot_runs``)."""
    return plot_runs([run_dir], out_dir)
