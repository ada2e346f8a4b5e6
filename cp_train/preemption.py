"""Save and stop on SIGTERM or SIGUSR1 (a preempted or time-limited Slurm job), so that the rerun resumes.

Slurm sends SIGUSR1 ahead of the time limit where the job asks for it (``#SBATCH --signal=B:USR1@180`` in
``launch/slurm.sbatch``, which forwards it to every task and requeues the job) and SIGTERM on preemption.
While the trainer runs, either signal only sets a flag on the rank that got it. At the next log step
(``logging.interval``: the steps read anyway) the ranks agree whether any of them got one, in the max over
the world that the log record takes anyway (``run_log.interval_record``), and if so all save a checkpoint
and stop with exit code 0; rerunning the same command resumes from it. A second SIGTERM before that point
ends the process as SIGTERM does by default.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """The signal flag of one training loop; a context manager that installs and restores the handlers."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for signum in SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: the signals keep their handlers
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGTERM and signum == signal.SIGTERM:  # the second one: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signal.Signals(signum)

    def code(self) -> float:
        """The signal this rank got (0: none), for the max over ranks the log step takes (``run_log``)."""
        return float(self.received or 0)

    @staticmethod
    def name(code: float) -> str | None:
        """The name of the signal ``code`` (the max over ranks of ``code()``), or None."""
        return signal.Signals(int(code)).name if code else None

    @staticmethod
    def stopped(name: str, step: int) -> str:
        """The note of a run stopped by signal ``name`` after saving at ``step``."""
        return f"{name} received: stopped at step {step} after saving a checkpoint; rerun the same command to resume"
