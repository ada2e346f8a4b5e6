"""Where metrics go, from one rank: a console line with a progress bar, ``metrics.jsonl`` and wandb.

wandb runs offline unless ``WANDB_API_KEY`` is set or ``logging.wandb_mode`` is ``online``; the
offline run lands in ``RUN_DIR/wandb/`` (``wandb sync`` uploads it later). A resumed run appends to its
``metrics.jsonl``; a fresh run into a directory that holds one moves it aside first (``set_aside``), so that no
run's records are ever overwritten. The run name and config
carry tp/cp/dp and seq_len, and the wandb group is the layout, so dashboards group by layout. A resumed run
continues its wandb run (the id and group its checkpoint saved), also after a layout change (logged as an event).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from cp_train.errors import InputError, one_line

METRICS_FILE = "metrics.jsonl"


def wandb_mode(configured: str | None) -> str:
    """``configured`` if given, else online with ``WANDB_API_KEY`` in the environment, else offline."""
    if configured:
        return configured
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def wandb_environment_problem(error: ValueError) -> str:
    """One line for wandb's refusal of its settings (a pydantic ``ValidationError``), naming the ``WANDB_*``
    variable each bad setting came from where one is set: ``WANDB_MODE='' (mode: Input should be ...)``."""
    details = error.errors() if callable(getattr(error, "errors", None)) else []
    problems = []
    for detail in details:
        name = ".".join(str(part) for part in detail.get("loc", ()))
        variable = f"WANDB_{name.upper()}"
        source = f"{variable}={os.environ[variable]!r}" if variable in os.environ else name
        problems.append(f"{source} ({name}: {detail.get('msg', 'invalid')})")
    return "; ".join(problems) or one_line(str(error))


def layout_group(layout: dict[str, Any]) -> str:
    """The wandb group of a layout: ``tp1-cp2-dp1-seq256``."""
    return f"tp{layout.get('tp')}-cp{layout.get('cp')}-dp{layout.get('dp')}-seq{layout.get('seq_len')}"


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _count(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def progress_bar(step: int, total: int, width: int = 20) -> str:
    done = min(width, int(width * step / max(total, 1)))
    return f"[{'#' * done}{'.' * (width - done)}] {100 * step / max(total, 1):3.0f}%"


def console_line(record: dict[str, Any], total_steps: int, started: float, first_step: int) -> str:
    """One line per record: progress, loss, lr, grad norm, throughput, MFU, timings, memory, ETA."""
    step = record["step"]
    if record.get("kind") == "setup":
        gib = {key: record[f"{key}_bytes_per_rank"] / 2**30 for key in ("state", "parameter", "gradient", "optimizer")}
        return (f"setup: {record['parameters']:,} parameters, {record['parameters_per_rank']:,} per rank; state "
                f"{gib['state']:.3f} GiB per rank (parameters {gib['parameter']:.3f}, gradients "
                f"{gib['gradient']:.3f}, optimizer {gib['optimizer']:.3f}; the largest rank)")
    if record.get("kind") == "event":
        return f"event step {step}: {record['event']} {record.get('detail', '')}".rstrip()
    if record.get("kind") == "profile":  # runtime/profiling.py
        kinds = ", ".join(f"{kind} {seconds:.3g} s" for kind, seconds in list(record["by_kind_s"].items())[:4])
        first, last = record["profiled_steps"]
        return (f"profile of steps {first}-{last} on rank {record['rank']}: {record['step_s']:.3f} s/step, the "
                f"{record['device']} idle {100 * record['idle_fraction']:.1f}% of it ({kinds} per step); trace "
                f"{record['trace']}")
    if record.get("kind") == "eval":
        return f"eval  step {step:>{len(str(total_steps))}}/{total_steps} | val loss {record['loss']:.4f} | " \
               f"val ppl {record['perplexity']:.2f}"
    elapsed = time.perf_counter() - started
    eta = elapsed / max(step - first_step, 1) * (total_steps - step)
    mfu = "n/a" if math.isnan(record["mfu"]) else f"{100 * record['mfu']:.1f}%"
    if "mfu_dense" in record and not math.isnan(record["mfu_dense"]):
        mfu += f" (causal; dense {100 * record['mfu_dense']:.1f}%)"
    memory = f"{record.get('peak_memory_max_gib', record['peak_memory_gib']):.2f}"
    if "peak_memory_reserved_gib" in record:
        memory += f"/{record['peak_memory_reserved_gib']:.2f} reserved"
    if record.get("peak_memory_pct") is not None:
        memory += f" GiB max, {record['peak_memory_pct']:.0f}%"
    else:
        memory += " GiB"
    step_time = record.get("step_time_max_s", record["step_time_s"])
    norms = f"gnorm {record['grad_norm']:.3f}" + (f" | pnorm {record['params_norm']:.3f}" if "params_norm" in record
                                                  else "")
    return (f"step {step:>{len(str(total_steps))}}/{total_steps} {progress_bar(step, total_steps)} | "
            f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | {norms} | "
            f"{_count(record['tokens_per_s'])} tok/s ({_count(record['tokens_per_s_per_device'])}/dev) | "
            f"{record['tflops_per_device']:.3f} TFLOP/s/dev | MFU {mfu} | "
            f"step {step_time:.3f}s data {record['data_time_s']:.3f}s | "
            f"mem {memory} | eta {_duration(eta)}")


def drop_records_after(path: Path, step: int) -> int:
    """Remove the records of steps after ``step`` from JSONL file ``path`` (a run resumed at ``step`` logs
    them again: plots and dashboards then show one curve). Rewritten atomically; returns how many went."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            superseded = json.loads(line).get("step", 0) > step
        except (json.JSONDecodeError, AttributeError, TypeError):
            superseded = True  # a half-written last line of a killed run
        if not superseded:
            kept.append(line)
    if len(kept) < len(lines):
        partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
        partial.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(partial, path)
    return len(lines) - len(kept)


def set_aside(path: Path) -> Path | None:
    """Rename a non-empty file ``path`` (``metrics.jsonl``) to ``metrics.<its last write, YYYYmmdd-HHMMSS>.jsonl``
    beside it (``-2``, ``-3``, ... when taken); returns the new path, or None when there was nothing to keep."""
    try:
        if path.stat().st_size == 0:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    except FileNotFoundError:
        return None
    target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    copies = 1
    while target.exists():
        copies += 1
        target = path.with_name(f"{path.stem}.{stamp}-{copies}{path.suffix}")
    os.replace(path, target)
    return target


@dataclass(frozen=True, kw_only=True)
class SinkSettings:
    """Where and what one run's writers write: ``metrics.jsonl`` (and wandb's offline run) in ``run_dir``, console
    lines with a progress bar to ``total_steps`` (when ``console``), a wandb run named ``run_name`` (when
    ``use_wandb``) that records ``config`` and ``layout`` (tp, cp, dp, seq_len: its group and tags).
    ``metrics.jsonl`` is appended to when ``append`` (a run resumed at ``first_step``: records of later steps,
    logged before the run stopped, are dropped first), else started afresh after an earlier run's file is moved
    aside (``set_aside``)."""

    run_dir: Path
    run_name: str
    total_steps: int
    first_step: int = 0
    append: bool = False
    console: bool = True
    config: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, int] = field(default_factory=dict)
    use_wandb: bool = False
    wandb_project: str = "cp-train"
    wandb_mode: str | None = None  # None: online with WANDB_API_KEY, else offline (``wandb_mode()``)
    wandb_id: str | None = None  # the wandb run to continue (a resumed run's, from its checkpoint)
    wandb_group: str | None = None  # its group (kept when the layout changed); None: the layout's


class MetricWriters:
    """Console, JSONL and wandb writers of one run (``settings``); every method is a no-op unless ``enabled``
    (one rank writes). Console lines go to ``stream`` (default stdout)."""

    def __init__(self, settings: SinkSettings, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        run_dir, layout, mode = settings.run_dir, settings.layout, settings.wandb_mode
        self.enabled, self.total_steps, self.first_step = enabled, settings.total_steps, settings.first_step
        self.console, self.stream = settings.console, stream or sys.stdout
        self.started = time.perf_counter()
        self.jsonl: TextIO | None = None
        self.wandb_run: Any = None
        self.wandb_group = settings.wandb_group or layout_group(layout)
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run appends to its metrics (dropping what it is about to redo), a fresh one starts a new file
        if settings.append:
            drop_records_after(run_dir / METRICS_FILE, settings.first_step)
        else:
            kept = set_aside(run_dir / METRICS_FILE)
            if kept is not None:
                self.message(f"{run_dir / METRICS_FILE} held an earlier run's metrics: moved to {kept.name} (this "
                             f"run starts a new file; to continue that run, resume it with --load)")
        self.jsonl = open(run_dir / METRICS_FILE, "a" if settings.append else "w", encoding="utf-8")  # noqa: SIM115
        if settings.use_wandb and wandb_mode(mode) != "disabled":
            try:
                import wandb  # slow import: only when used
            except ImportError:  # a declared dependency, but machines without it should still train
                self.message("wandb is not installed: metrics go to metrics.jsonl only "
                             "(pip install wandb, or set logging.wandb=false to silence this)")
                return
            resume = {"id": settings.wandb_id, "resume": "allow"} if settings.wandb_id else {}
            try:
                self.wandb_run = wandb.init(
                    project=settings.wandb_project, name=settings.run_name, dir=str(run_dir), mode=wandb_mode(mode),
                    group=self.wandb_group, config={**settings.config, "layout": layout},
                    tags=[f"cp{layout['cp']}", f"seq{layout['seq_len']}"], reinit="finish_previous", **resume)
            except ValueError as error:  # its settings, read from WANDB_* variables too, failed validation
                self.close()
                raise InputError(f"wandb refused its settings: {wandb_environment_problem(error)}: fix or unset the "
                                 f"variable, or set logging.wandb=false") from None
            except wandb.Error as error:  # no API key for an online run, a bad project name, ...
                self.close()
                why = one_line(str(error))
                raise InputError(f"wandb could not start its {wandb_mode(mode)} run ({why}): set WANDB_API_KEY or run "
                                 f"`wandb login`, or use --wandb-mode offline or disabled") from None

    def wandb_state(self) -> dict[str, str] | None:
        """The wandb run's id and group, for a checkpoint to resume it with (None without a wandb run)."""
        return {"id": self.wandb_run.id, "group": self.wandb_group} if self.wandb_run is not None else None

    def message(self, text: str) -> None:
        if self.enabled and self.console:
            print(f"[cp-train] {text}", file=self.stream, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` (it carries ``step`` and ``loss``) to every writer."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        assert self.jsonl is not None
        self.jsonl.write(json.dumps({**clean, "time": time.time()}) + "\n")
        self.jsonl.flush()
        if self.console:
            print(console_line(record, self.total_steps, self.started, self.first_step), file=self.stream,
                  flush=True)
        if self.wandb_run is not None and record.get("kind") == "setup":
            self.wandb_run.summary.update({f"setup/{k}": v for k, v in record.items() if isinstance(v, int | float)})
            self.wandb_run.config.update({k: v for k, v in record.items() if isinstance(v, str)},
                                         allow_val_change=True)  # the attention kernels, say
        elif self.wandb_run is not None and record.get("kind") == "event":
            self.wandb_run.log({f"event/{record['event']}": 1}, step=record["step"])
        elif self.wandb_run is not None:
            prefix = {"eval": "eval/", "profile": "profile/"}.get(record.get("kind"), "train/")
            self.wandb_run.log({prefix + k: v for k, v in record.items() if isinstance(v, int | float)
                                and k != "step"}, step=record["step"])

    def close(self, quiet: bool = False) -> None:
        """Close the JSONL file and finish the wandb run. Closed while an exception propagates (Ctrl-C, a failure:
        the entry point's one line follows) or ``quiet`` (a signal's stop: its line is the last), wandb finishes
        without its summary and sync hints on the console."""
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb_run is not None:
            failing = sys.exc_info()[1]
            if failing is None and not quiet:
                self.wandb_run.finish()
            else:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    self.wandb_run.finish(exit_code=0 if failing is None else 130 if isinstance(
                        failing, KeyboardInterrupt) else 1)
            self.wandb_run = None
