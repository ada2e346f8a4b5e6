"""Save and stop on SIGTERM, SIGUSR1 or Ctrl-C, so that the rerun resumes.

Slurm sends SIGTERM to every process of a preempted job (the launcher and every rank) and, where the job asks for
it, SIGUSR1 ahead of the time limit (``#SBATCH --signal=B:USR1@180`` in ``launch/slurm.sbatch``, which forwards it
to every task and requeues the job); Ctrl-C is SIGINT. While the trainer runs, a signal only sets a flag on the
rank that got it. After every optimizer step the ranks agree whether any of them got one (one all-reduce of a
number over the host's gloo group: no GPU sync), and if so all save a checkpoint and stop with exit code 0;
rerunning the same command resumes from it. Further SIGTERMs change nothing (plain torchrun relays the one it got,
then kills its ranks 30 s later: a step and a save must fit in that, or launch through ``cp_train.cli.launch``,
which waits for them); a second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signal.Signals(signum)

    def code(self) -> float:
        """The signal this rank got (0: none), for the max over ranks."""
        return float(self.received or 0)

    def agreed(self, group: dist.ProcessGroup | None) -> str | None:
        """The name of the signal any rank of ``group`` (the host's gloo group, every rank) got, or None
        (collective: every rank calls it after every step)."""
        # its own all-reduce rather than ``max_over_ranks``: the read below is a host tensor's, not a ``tolist`` the
        # sync tests count between log steps
        code = torch.tensor([self.code()], dtype=torch.float64)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
        return self.name(float(code.numpy()[0]))  # a host tensor of the gloo group: no device read

    @staticmethod
    def name(code: float) -> str | None:
        """The name of the signal ``code`` (the max over ranks of ``code()``), or None."""
        return signal.Signals(int(code)).name if code else None

    @staticmethod
    def stopped(name: str, step: int, saved: bool) -> str:
        """The one line of a run stopped by signal ``name`` at ``step``, ``saved`` or not (no ``checkpoint.save``)."""
        if saved:
            return (f"{name} received: stopped at step {step} after saving a checkpoint; rerun the same command to "
                    f"resume")
        return (f"{name} received: stopped at step {step} without a checkpoint (checkpoint.save is not set: set --save "
                f"DIR to make a stop resumable)")
