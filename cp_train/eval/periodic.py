"""The long-context evaluation inside training: ``eval.every`` steps (and the last), ``eval.tasks`` on the
run's model through the same CP forward, logged to ``metrics.jsonl`` (``{"kind": "long_eval", "step", ...}``,
one line per record), wandb (``long_eval/...`` scalars and tables) and a console summary.

The defaults (passkey at depths 0, 0.5, 1 with 2 trials and 4 held-out samples, at ``data.seq_len``) cost
a few dozen forwards per evaluation; the trainer excludes the time from its throughput.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cp_train.config.schema import Config
from cp_train.eval.context import build_context
from cp_train.eval.report import wandb_log
from cp_train.eval.tasks import EvalContext, EvalSettings, Record, check_lengths, run_tasks
from cp_train.model.parallelize import release_gathered


def settings_of(config: Config) -> EvalSettings:
    """The ``eval`` section as ``EvalSettings`` (``InputError`` for an unknown task or a bad grid)."""
    e = config.eval
    return EvalSettings(tasks=list(e.tasks), lengths=list(e.lengths) or [config.data.seq_len], depths=list(e.depths),
                        trials=e.trials, seed=e.seed, loss_samples=e.loss_samples)


def summary(step: int, records: list[Record], seconds: float) -> str:
    """One console line: each grid's mean accuracy and the loss of the last position bucket."""
    parts = []
    for task in ("passkey", "niah"):
        rows = [r for r in records if r["task"] == task]
        if rows:
            parts.append(f"{task} {sum(r['accuracy'] for r in rows) / len(rows):.3f}")
    buckets = [r for r in records if r["task"] == "loss_by_position"]
    if buckets:
        parts.append(f"nll@{buckets[-1]['bucket_start']}-{buckets[-1]['bucket_end']} {buckets[-1]['nll']:.4f}")
    return f"long eval step {step}: {', '.join(parts)} ({seconds:.1f}s)"


class PeriodicEval:
    """Checks ``config.eval`` at construction (a bad task fails before step 1); ``run`` evaluates the trainer's
    model (collective: every rank calls it at the same steps)."""

    def __init__(self, config: Config) -> None:
        self.every = config.eval.every
        self.settings = settings_of(config) if self.every else None
        if self.settings is not None:
            check_lengths(self.settings.lengths, config.model, config.parallel.cp, config.parallel.cp_layout)
        self._context: EvalContext | None = None

    def due(self, step: int, last: int) -> bool:
        """Whether step ``step`` (1-based) of a run ending at ``last`` runs the evaluation."""
        return bool(self.every) and (step % self.every == 0 or step == last)

    def run(self, trainer: Any, writers: Any) -> list[Record]:
        """Evaluate ``trainer.model`` (a ``Trainer``) and log the records to ``writers`` (``MetricWriters``)."""
        assert self.settings is not None
        started = time.perf_counter()
        env = trainer.env
        if self._context is None:
            sources = env.sources
            self._context = build_context(env.config, trainer.state, trainer.model, sources.eval_prefix,
                                          sources.tokenizer, sources.eod_id, sources.pad_id, env.device,
                                          env.autocast_dtype)
        trainer.model.eval()
        try:
            records = run_tasks(self.settings, self._context)
        finally:
            trainer.model.train()
            release_gathered(trainer.model)  # as after a training step: every parameter sharded
        step = trainer.step
        if writers.enabled and writers.jsonl is not None:
            for record in records:
                line = json.dumps({"kind": "long_eval", "step": step, **record, "time": time.time()})
                writers.jsonl.write(line + "\n")
            writers.jsonl.flush()
        if writers.enabled and writers.wandb_run is not None:
            wandb_log(writers.wandb_run, records, [], step=step)
        writers.message(summary(step, records, time.perf_counter() - started))
        return records
