"""A scheduled ``torch.profiler`` over chosen steps of a run (``logging.profile``; Megatron-LM's ``--profile``).

Steps ``logging.profile_step_start`` to ``logging.profile_step_end - 1`` (numbered as the run numbers them, from 1)
are recorded on the ranks in ``logging.profile_ranks``, after one warm-up step, so the profiler's own start falls
outside them. Each of those ranks writes its Chrome trace to ``<run dir>/profile/rank{R}-steps{A}-{B}.json.gz``
(ui.perfetto.dev or chrome://tracing) and, with ``logging.memory_snapshot`` (CUDA), the caching allocator's history
over the same steps to ``rank{R}-steps{A}-{B}-memory.pickle`` (pytorch.org/memory_viz). ``after_step`` returns the
figures (``metrics/trace.py``: step time, busy time, idle fraction, time by kernel kind, the longest kernels) as one
``profile`` record, which rank 0 logs. Recording, exporting and reading the trace cost only the profiled ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from cp_train.config.schema import Config, ConfigError, LoggingConfig
from cp_train.metrics.trace import copies, longest, summary

MEMORY_EVENTS = 100_000  # allocator events the memory snapshot keeps (the newest)


def check_profile_device(config: Config, device: torch.device) -> None:
    """ConfigError when ``logging.memory_snapshot`` asks for CUDA's allocator history on another device."""
    if config.logging.memory_snapshot and device.type != "cuda":
        raise ConfigError(f"logging.memory_snapshot records CUDA's caching allocator, and this run is on "
                          f"{device.type}: set logging.memory_snapshot=false (logging.profile still traces the steps)")


class StepProfiler:
    """The profiler of one rank's run; ``first_step``: the step the run starts from (0, or the resumed step)."""

    def __init__(self, logging: LoggingConfig, rank: int, device: torch.device, run_dir: Path,
                 first_step: int) -> None:
        self.start, self.end = logging.profile_step_start, logging.profile_step_end
        self.on = logging.profile and rank in logging.profile_ranks and first_step < self.start
        self.missed = logging.profile and first_step >= self.start  # resumed past the profiled steps
        self.warmup = 1 if self.start > first_step + 1 else 0
        self.cuda, self.memory = device.type == "cuda", logging.memory_snapshot and device.type == "cuda"
        self.stem = run_dir / "profile" / f"rank{rank}-steps{self.start}-{self.end - 1}"
        self.rank = rank
        self._profiler: profile | None = None
        self._ready = False

    def note(self) -> str | None:
        """The line to log when the run resumed past the profiled steps (nothing was recorded)."""
        if not self.missed:
            return None
        return (f"logging.profile: steps {self.start}-{self.end - 1} ran before the step this run resumed from; "
                f"nothing is profiled (set logging.profile_step_start and _end past it)")

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def before_step(self, step: int) -> None:
        """Start recording when ``step`` (the step about to run) is the warm-up step, or the first profiled one."""
        if not self.on or self._profiler is not None or step != self.start - self.warmup:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        plan = schedule(skip_first=step, wait=0, warmup=self.warmup, active=self.end - self.start, repeat=1)
        # shapes in the trace (as torchtitan's profiler records them): which copy a kernel belongs to
        self._profiler = profile(activities=activities, schedule=plan, on_trace_ready=self._mark_ready,
                                 record_shapes=True)
        # the profiler counts from the run's step, so the trace's ProfilerStep#N is the run's step N
        self._profiler.step_num, self._profiler.current_action = step, plan(step)
        self._profiler.start()
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)

    def _mark_ready(self, _: profile) -> None:
        self._ready = True

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Mark the end of step ``step`` (no synchronisation: the device's queue runs on); after the last profiled
        step, write the trace (and the memory snapshot) and return the ``profile`` record."""
        if self._profiler is None:
            return None
        self._profiler.step()
        if not self._ready:
            return None
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        files = {"trace": f"{self.stem}.json.gz"}
        if self.memory:
            files["memory_snapshot"] = f"{self.stem}-memory.pickle"
            torch.cuda.memory._dump_snapshot(files["memory_snapshot"])
        prof, steps = self._profiler, self.end - self.start
        events = list(prof.events())
        prof.export_chrome_trace(files["trace"])
        self._close()
        figures = summary(events, self.cuda, steps)
        top = [[name, round(ms / steps, 3)] for name, ms in longest(events, self.cuda)]
        copied = [[label, round(ms / steps, 3)] for label, ms in copies(events)]
        return {"kind": "profile", "step": step, "profiled_steps": [self.start, self.end - 1], "rank": self.rank,
                **figures, "longest_ms": top, "copies_ms": copied, **files}

    def _close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)
        self.on = False
