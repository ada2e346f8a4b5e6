"""Where the evaluation's records go: JSON lines, a table on stdout, PNGs (heatmaps of the grids, a line of
the loss by position) when matplotlib is installed, and wandb tables and images when it is on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]
NO_MATPLOTLIB = "matplotlib is not installed: no PNGs (pip install matplotlib); the records are in {path}"


def write_jsonl(records: Sequence[Record], path: Path) -> Path:
    """``records`` as JSON lines at ``path`` (the directory is made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _by_task(records: Sequence[Record], task: str) -> list[Record]:
    return [r for r in records if r["task"] == task]


def loss_table(records: Sequence[Record]) -> list[str]:
    """The loss-by-position buckets as text lines (empty without any)."""
    rows = _by_task(records, "loss_by_position")
    if not rows:
        return []
    lines = ["loss_by_position: NLL by position within the document (nats)",
             f"  {'positions':>13} {'nll':>9} {'cum_nll':>9} {'tokens':>8}"]
    for r in rows:
        lines.append(f"  {r['bucket_start']:>6}-{r['bucket_end']:<6} {r['nll']:>9.4f} {r['cum_nll']:>9.4f} "
                     f"{r['tokens']:>8}")
    return lines


def grid_table(records: Sequence[Record], task: str) -> list[str]:
    """``task``'s grid as text: rows are depths, columns lengths, cells ``accuracy (key_logprob)``."""
    rows = _by_task(records, task)
    if not rows:
        return []
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cell = {(r["length"], r["depth"]): r for r in rows}
    lines = [f"{task}: accuracy (mean key log-prob), {rows[0]['trials']} trials per cell",
             "  " + f"{'depth':>6}" + "".join(f"{length:>20}" for length in lengths)]
    for depth in depths:
        text = "".join(f"{cell[(length, depth)]['accuracy']:>9.2f} ({cell[(length, depth)]['key_logprob']:>8.2f})"
                       if (length, depth) in cell else f"{'':>20}" for length in lengths)
        lines.append(f"  {depth:>6.2f}{text}")
    mean = sum(r["accuracy"] for r in rows) / len(rows)
    lines.append(f"  mean accuracy {mean:.3f}")
    return lines


def table(records: Sequence[Record]) -> str:
    """Every task's table, one block each."""
    blocks = [loss_table(records)] + [grid_table(records, task) for task in ("passkey", "niah")]
    return "\n".join("\n".join(block) for block in blocks if block)


def plots(records: Sequence[Record], out_dir: Path) -> tuple[list[Path], str | None]:
    """PNGs of ``records`` in ``out_dir``: ``TASK_heatmap.png`` per grid, ``loss_by_position.png``. Returns the
    paths and None, or no paths and the one-line note that matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], NO_MATPLOTLIB.format(path=out_dir / "eval.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = _by_task(records, "loss_by_position")
    if rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        ends = [r["bucket_end"] for r in rows]
        ax.plot(ends, [r["nll"] for r in rows], marker="o", label="bucket NLL")
        ax.plot(ends, [r["cum_nll"] for r in rows], marker=".", label="cumulative NLL")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position within the document (bucket end)")
        ax.set_ylabel("NLL (nats)")
        ax.legend()
        paths.append(_save(fig, out_dir / "loss_by_position.png", plt))
    for task in ("passkey", "niah"):
        rows = _by_task(records, task)
        if not rows:
            continue
        lengths, depths = sorted({r["length"] for r in rows}), sorted({r["depth"] for r in rows})
        grid = [[next((r["accuracy"] for r in rows if r["length"] == n and r["depth"] == d), float("nan"))
                 for n in lengths] for d in depths]
        fig, ax = plt.subplots(figsize=(2.6 + 0.9 * len(lengths), 1.8 + 0.45 * len(depths)))
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("depth")
        ax.set_title(f"{task} accuracy")
        fig.colorbar(image, ax=ax)
        paths.append(_save(fig, out_dir / f"{task}_heatmap.png", plt))
    return paths, None


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def wandb_log(run: Any, records: Sequence[Record], images: Sequence[Path], step: int | None = None,
              prefix: str = "long_eval") -> None:
    """``records`` as one wandb table per task and ``images`` as wandb images, in the open ``run``."""
    import wandb

    logged: dict[str, Any] = {}
    for task in sorted({r["task"] for r in records}):
        rows = _by_task(records, task)
        columns = list(rows[0])
        logged[f"{prefix}/{task}"] = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
    for path in images:
        logged[f"{prefix}/{path.stem}"] = wandb.Image(str(path))
    run.log(logged, step=step)
