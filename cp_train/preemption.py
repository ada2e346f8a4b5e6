"""Save and stop on SIGTERM, SIGUSR1 or Ctrl-C, at the run's time limit or every N steps, so that the rerun resumes.

Slurm sends SIGTERM to every process of a preempted job (the launcher and every rank) and, where the job asks for
it, SIGUSR1 ahead of the time limit (``#SBATCH --signal=B:USR1@180`` in ``launch/slurm.sbatch``, which forwards it
to every task and requeues the job); Ctrl-C is SIGINT. While the trainer runs, a signal only sets a flag on the
rank that got it. After every optimizer step the ranks agree whether any of them got one (one all-reduce of a
number over the host's gloo group: no GPU sync), and if so all save a checkpoint and stop with exit code 0;
rerunning the same command resumes from it. Further SIGTERMs change nothing (plain torchrun relays the one it got,
then kills its ranks 30 s later: a step and a save must fit in that, or launch through ``cp_train.cli.launch``,
which waits for them); a second Ctrl-C stops at once.

Megatron-LM's other two ways to end a job early stop the same way, in the same all-reduce:
``train.exit_duration_minutes`` (``--exit-duration-in-mins``), after the first step that ends that many minutes
after the trainer started building the run (any rank's clock: the max over ranks), and ``train.exit_interval``
(``--exit-interval``), after every step that is a multiple of it. Neither stops the run's last step, which ends
the run anyway; a signal names itself first.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from cp_train.config.schema import TrainConfig

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
TIME_LIMIT = 0.5  # the time limit's code: below every signal's number, so that the max over ranks names a signal


class Preemption:
    """The stop flag of one training loop; a context manager that installs and restores the signal handlers.
    ``train``: the run's ``exit_duration_minutes`` and ``exit_interval``; ``started``: ``time.monotonic()`` when the
    trainer started building the run."""

    def __init__(self, train: TrainConfig, started: float) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}
        self.minutes, self.interval = train.exit_duration_minutes, train.exit_interval
        self.deadline = started + 60.0 * self.minutes

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
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signal.Signals(signum)

    def code(self) -> float:
        """This rank's reason to stop, for the max over ranks: the signal it got, else ``TIME_LIMIT`` past the
        deadline, else 0."""
        if self.received is not None:
            return float(self.received)
        return TIME_LIMIT if self.minutes > 0 and time.monotonic() >= self.deadline else 0.0

    def agreed(self, group: dist.ProcessGroup | None, step: int, last: int) -> str | None:
        """Why the ranks of ``group`` (the host's gloo group, every rank) stop after ``step`` (the run's last step is
        ``last``), as the stop line's opening words, or None (collective: every rank calls it after every step)."""
        # its own all-reduce rather than ``max_over_ranks``: the read below is a host tensor's, not a ``tolist`` the
        # sync tests count between log steps
        code = torch.tensor([self.code()], dtype=torch.float64)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
        return self.reason(float(code.numpy()[0]), step, last)  # a host tensor of the gloo group: no device read

    def reason(self, code: float, step: int, last: int) -> str | None:
        """The stop line's opening words for ``code`` (the max over ranks of ``code()``) after ``step``, or None."""
        if code >= 1:
            return f"{signal.Signals(int(code)).name} received"
        if step >= last:  # the run ends here anyway
            return None
        if code:
            return f"the time limit (train.exit_duration_minutes {self.minutes:g}) reached"
        if self.interval and step % self.interval == 0:
            return f"train.exit_interval {self.interval} reached"
        return None

    @staticmethod
    def stopped(reason: str, step: int, saved: bool) -> str:
        """The one line of a run stopped for ``reason`` (``agreed``'s words) at ``step``, ``saved`` or not (no
        ``checkpoint.save``)."""
        if saved:
            return f"{reason}: stopped at step {step} after saving a checkpoint; rerun the same command to resume"
        return (f"{reason}: stopped at step {step} without a checkpoint (checkpoint.save is not set: set --save "
                f"DIR to make a stop resumable)")
