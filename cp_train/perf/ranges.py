"""An error range on every prediction, from the planner's own error on measured runs like it.

``bench/planner_published.py --write`` predicts every measured run (``inputs/measured_runs.yaml``) and records its
error (predicted / measured - 1) and regime in ``inputs/run_errors.yaml``. A regime is a class in four
dimensions: the model (``small`` under ``SMALL_PARAMETERS``, where the host weighs, or ``large``), the sequence
(``short`` under 65,536 tokens, or ``long``), the linears' precision (``bf16``, ``fp8``) and the nodes (``one``,
``many``); attention-only runs form their own. A range takes the runs of its regime; with fewer than ``MIN_RUNS``
the last dimensions are dropped in turn (the model class always kept). It spans their errors in log space padded
on each side by their mean gap, ``(max - min) / (n - 1)``, the expected distance from the extremes of ``n`` runs
to the ends of a uniform spread; a throughput ``t`` is then expected between ``t / (1 + high)`` and
``t / (1 + low)``. A further run lands outside the span of ``n`` exchangeable runs with probability
``2 / (n + 1)``, 1 in 6 at 11 runs before the padding: hence ``MIN_RUNS``. Nothing is fitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

ERRORS_FILE = Path(__file__).with_name("inputs") / "run_errors.yaml"
SMALL_PARAMETERS = 3e9
LONG_SEQUENCE = 65536
MIN_RUNS = 11
Regime = tuple[str, ...]


def regime_of(parameters: float, seq_len: int, precision: str, gpus: int, gpus_per_node: int) -> Regime:
    """The regime of a layout (see the module docstring)."""
    return ("small" if parameters < SMALL_PARAMETERS else "large", "long" if seq_len >= LONG_SEQUENCE else "short",
            precision, "many" if gpus > gpus_per_node else "one")


@dataclass(frozen=True)
class ErrorBand:
    """The errors (predicted / measured - 1) a prediction of ``regime`` is expected between, from ``runs``."""

    regime: Regime  # the regime the runs were taken from (possibly coarser than the prediction's)
    low: float
    high: float
    runs: tuple[str, ...]

    def throughput(self, predicted: float) -> tuple[float, float]:
        """``(low, high)`` of a throughput predicted at ``predicted``."""
        return predicted / (1 + self.high), predicted / (1 + self.low)

    def seconds(self, predicted: float) -> tuple[float, float]:
        """``(low, high)`` of a time predicted at ``predicted``."""
        return predicted * (1 + self.low), predicted * (1 + self.high)

    @property
    def width(self) -> float:
        """high / low of the range (the same for every quantity)."""
        return (1 + self.high) / (1 + self.low)

    def contains(self, error: float) -> bool:
        return self.low <= error <= self.high


@lru_cache(maxsize=1)
def run_errors() -> dict[str, tuple[Regime, float]]:
    """``{run key: (regime, error)}`` as ``bench/planner_published.py --write`` recorded them."""
    rows = yaml.safe_load(ERRORS_FILE.read_text(encoding="utf-8"))["runs"]
    return {row["key"]: (tuple(row["regime"]), float(row["error"])) for row in rows}


def band(regime: Regime, errors: dict[str, tuple[Regime, float]] | None = None, leave_out: str | None = None
         ) -> ErrorBand:
    """The band of ``regime`` from ``errors`` (default: the recorded ones) without the run ``leave_out``."""
    errors = run_errors() if errors is None else errors
    pool = {key: value for key, value in errors.items() if key != leave_out}
    for depth in range(len(regime), 0, -1):
        runs = {key: error for key, (other, error) in pool.items() if other[:depth] == regime[:depth]}
        if len(runs) >= MIN_RUNS or depth == 1:
            break
    if len(runs) < 2:
        raise ValueError(f"fewer than two measured runs in regime {'/'.join(regime)}: rerun "
                         f"bench/planner_published.py --write")
    logs = sorted(math.log1p(error) for error in runs.values())
    pad = (logs[-1] - logs[0]) / (len(logs) - 1)
    return ErrorBand(regime[:depth], math.expm1(logs[0] - pad), math.expm1(logs[-1] + pad), tuple(sorted(runs)))

