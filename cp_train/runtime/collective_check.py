"""``parallel.check_collectives``: the run's guard over its ranks' collectives (``parallel/mesh/collective_check.py``).

At each log step every rank's collectives since the last one are compared over the host group; a difference stops
the run with one line naming the first differing call and the ranks (``RunFailure``). While a rank waits in a
collective longer than half of ``parallel.timeout_minutes`` (at most a minute), the lowest such rank compares the
members' recent calls through the store and, where one skipped the call or issued another, prints that line and
exits, before the timeout would name only the call it hung in.
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch.distributed as dist

from cp_train.errors import RunFailure, write_torchelastic_error_file
from cp_train.parallel.mesh.collective_check import CollectiveCheck
from cp_train.parallel.mesh.state import ParallelState

STALL_SECONDS_MAX = 60.0
HINT = ("a rank issued its collectives in another order, skipped one or issued another (NCCL would hang or mix "
        "their buffers): look at the code at the places named")


ROLES = ("tp", "cp", "dp", "dp_cp", "tp_cp", "cp_ulysses", "cp_ring")


class CollectiveGuard:
    """The check on ``state``'s host group (every rank, gloo), started at once; groups are named by their role in
    ``state`` (cp, dp_cp, ...); ``prog`` names the command in the line."""

    def __init__(self, state: ParallelState, timeout_minutes: float, prog: str = "train.py") -> None:
        self.prog = prog
        self.roles = {state.host_group.group_name: "host"}
        for role in ROLES:
            axis = getattr(state, role, None)
            if axis is not None:
                self.roles.setdefault(axis.group.group_name, role)
        host_group = state.host_group
        stall = min(STALL_SECONDS_MAX, timeout_minutes * 60 / 2)
        self.period = min(2.0, stall / 3)
        self.check = CollectiveCheck(host_group, stall, self._stop_on_stall, self._leave_quietly, self.period)
        self.check.start()

    def at_log_step(self, step: int) -> None:
        """Compare every rank's collectives since the last log step (collective); RunFailure on a difference."""
        line = self.check.compare()
        if line is not None:
            raise RunFailure(f"collective check at step {step}: {self.named(line)}; {HINT}")

    def named(self, line: str) -> str:
        """``line`` with each group called by its role: ``the cp group (ranks 0, 1)``."""
        return re.sub(r"group (\S+) \(", lambda m: f"the {self.roles[m.group(1)]} group (" if m.group(1) in self.roles
                      else m.group(0), line)

    def _stop_on_stall(self, line: str) -> None:
        text = f"rank {dist.get_rank()}: {self.named(line)}; {HINT}"
        print(f"{self.prog}: failed: {text}", file=sys.stderr, flush=True)
        write_torchelastic_error_file(text)
        sys.stdout.flush()
        silent = os.open(os.devnull, os.O_WRONLY)
        os.dup2(silent, 1)  # the main thread's error once the peers leave is this line's echo: not printed
        os.dup2(silent, 2)
        time.sleep(2 * self.period)  # the other ranks' watchdogs see the report and leave first, quietly
        os._exit(1)  # the main thread is blocked in the collective: as NCCL's watchdog, end the process

    def _leave_quietly(self, reporter: int) -> None:
        write_torchelastic_error_file(f"{self.prog} stopped: see rank {reporter}'s collective check")
        os._exit(1)

    def close(self) -> None:
        self.check.stop()
