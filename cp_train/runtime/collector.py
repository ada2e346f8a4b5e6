"""Python's garbage collector on the run's schedule (``train.gc_interval``), as torchtitan and Megatron do.

Left automatic, the cyclic collector pauses each rank when its own allocation counts say so: at different
moments on different ranks, and every collective then waits for the slowest rank's pause. Here automatic
collection is off for the run, the objects alive after the first step (the model, the optimizer, the
compiled code) are frozen out of every later scan (``gc.freeze``), and every ``interval`` steps each rank
collects the young generations at the same step. Interval 0 leaves the collector as it was. A process that froze
objects before the run (a spawned test rank freezes its imports) keeps its freeze: the run neither freezes nor
unfreezes then (``gc.unfreeze`` would thaw the process's objects with the run's).
"""

from __future__ import annotations

import gc
from types import TracebackType


class ScheduledCollection:
    """``with ScheduledCollection(interval) as collection:`` around the training loop, ``collection.after_step(
    step, first)`` after each optimizer step; the collector's state is restored on exit."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._was_enabled = True
        self._frozen = self._froze = False  # objects frozen before the first step; by this run

    def __enter__(self) -> ScheduledCollection:
        self._was_enabled = gc.isenabled()
        self._frozen = gc.get_freeze_count() > 0  # frozen by the process before the run: left as it is
        self._froze = False
        if self.interval:
            gc.collect()  # what the build left behind, before automatic collection stops
            gc.disable()
        return self

    def after_step(self, step: int, first: bool) -> None:
        """``step``: the optimizer steps done; ``first``: the run's (or the resumed run's) first step here."""
        if not self.interval:
            return
        if first and not self._frozen:
            gc.freeze()
            self._frozen = self._froze = True
        elif step % self.interval == 0:
            gc.collect(1)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._froze:
            gc.unfreeze()
        if self.interval and self._was_enabled:
            gc.enable()
