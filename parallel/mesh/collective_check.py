"""``parallel.check_collectives``: the ranks' collectives compared while a run goes (``trace.py`` records them).

Two checks, neither on the GPU's stream:

- ``compare()`` at log steps: every rank's calls since the last check, per group, as digests over the host (gloo)
  group; where they differ, the records themselves, and the first differing call named in one line (collective).
- a daemon thread every ``period`` seconds publishes this rank's recent calls per group, and the call it is blocked
  in, to the store; a rank blocked longer than ``stall_seconds`` compares them with the other members' and, where a
  member issued fewer calls on that group and waits elsewhere (it skipped the call, or issued its calls in another
  order), reports the first differing call through ``report`` (the trainer prints the line and exits, as NCCL's
  watchdog aborts). Only the lowest stalled rank reports (the first to claim the report when two see the stall
  at once).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from cp_train.parallel.mesh.trace import TRACE, Call, check_records, record

KEY = "cp_train/collectives/{rank}"
STOPPED = "cp_train/collectives/stopped"  # the rank that reported a stall: the others leave quietly
CLAIMED = "cp_train/collectives/claimed"  # counts the ranks about to report: the first one does


def _digest(items: list[str]) -> tuple[int, str]:
    return len(items), hashlib.blake2b("\n".join(items).encode(), digest_size=8).hexdigest()


def digests(taken: dict[str, Any]) -> dict[str, Any]:
    """(count, hash) of each group's calls and each channel's messages in ``Trace.take()``'s record."""
    return {"calls": {name: _digest([f"{c.kind} {c.what}" for c in calls]) for name, calls in taken["calls"].items()},
            "messages": {key: _digest(what) for key, what in taken["messages"].items()}}


def _agree(every: dict[int, dict[str, Any]], members: dict[str, tuple[int, ...]]) -> bool:
    for name, ranks in members.items():
        if len({str(every[r]["calls"].get(name, (0, ""))) for r in ranks if r in every}) > 1:
            return False
    channels = {key[:3] for d in every.values() for key in d["messages"]}
    return all(every.get(src, {"messages": {}})["messages"].get((g, src, dst, "send"), (0, "")) ==
               every.get(dst, {"messages": {}})["messages"].get((g, src, dst, "recv"), (0, ""))
               for g, src, dst in channels)


class CollectiveCheck:
    """The run-time check over ``host_group`` (a gloo group of every rank). From the watchdog thread,
    ``report(line)`` gets the stall's line on the reporting rank, after it has told the others, which are handed
    ``quiet(rank)`` (the reporting rank) first, so that one line is printed."""

    def __init__(self, host_group: dist.ProcessGroup, stall_seconds: float, report: Callable[[str], None],
                 quiet: Callable[[int], None], period: float = 2.0) -> None:
        self.group, self.stall_seconds, self.report, self.period = host_group, stall_seconds, report, period
        self.quiet = quiet
        self.rank = dist.get_rank()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        record()

    def compare(self) -> str | None:
        """One line for the first call the members of a group disagree on since the last comparison, else None."""
        TRACE.paused += 1
        try:
            mine = TRACE.take()
            every: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, (self.rank, digests(mine), mine["members"]), group=self.group)
            members = {name: ranks for _, _, groups in every for name, ranks in groups.items()}
            if _agree({rank: d for rank, d, _ in every}, members):
                return None
            full: list[Any] = [None] * len(every)
            dist.all_gather_object(full, (self.rank, mine), group=self.group)
        finally:
            TRACE.paused -= 1
        return check_records(dict(full))

    # ---------------------------------------------------------------- the stall watchdog
    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="cp-train-collective-check", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict[str, Any]:
        """This rank's recent calls per group (with their numbers) and the call it is blocked in."""
        waiting = TRACE.waiting
        return {"rank": self.rank, "members": {name: list(r) for name, r in TRACE.members.items()},
                "totals": dict(TRACE.totals),
                "recent": {name: [[n, c.kind, c.what, c.site] for n, c in list(calls)]
                           for name, calls in list(TRACE.recent.items())},
                "waiting": None if waiting is None else [waiting[0], waiting[1], str(waiting[2]),
                                                        time.monotonic() - waiting[3]]}

    def _watch(self) -> None:
        store = c10d._get_default_store()
        while not self._stop.wait(self.period):
            try:
                if store.check([STOPPED]):
                    self.quiet(int(store.get(STOPPED)))
                    return
                mine = self.snapshot()
                store.set(KEY.format(rank=self.rank), json.dumps(mine))
                if mine["waiting"] is None or mine["waiting"][3] < self.stall_seconds:
                    continue
                others = [json.loads(store.get(KEY.format(rank=r))) for r in range(dist.get_world_size())
                          if r != self.rank and store.check([KEY.format(rank=r)])]
                if any(o["waiting"] and o["waiting"][3] >= self.stall_seconds and o["rank"] < self.rank
                       for o in others):
                    continue  # the lowest stalled rank reports
                line = explain_stall(mine, others)
            except (RuntimeError, ValueError, KeyError):  # a store read during teardown: try again later
                continue
            if line is not None and store.add(CLAIMED, 1) == 1:  # atomic: one report, whatever the timing
                store.set(STOPPED, str(self.rank))
                self.report(line)
                return


def _call(entry: list[Any]) -> str:
    return str(Call(entry[1], entry[2], entry[3]))


def explain_stall(mine: dict[str, Any], others: list[dict[str, Any]]) -> str | None:
    """One line for a stalled rank (``mine``, a ``snapshot``) whose group has a member that issued fewer calls on
    it and waits elsewhere: the first call they differ on (or the call the member never issued); else None."""
    group, number, call, seconds = mine["waiting"]
    ranks = mine["members"].get(group, [])
    for other in others:
        if other["rank"] not in ranks or other["totals"].get(group, 0) >= number:
            continue
        theirs = {entry[0]: entry for entry in other["recent"].get(group, [])}
        differ = next(((n, c) for n, *c in mine["recent"].get(group, []) if n in theirs and theirs[n][1:3] != c[:2]),
                      None)
        where = other["waiting"]
        elsewhere = f"waits in call {where[1]} on group {where[0]} ({where[2]})" if where else "is not in a collective"
        if differ is not None:
            first = (f"they differ first at call {differ[0]}: rank {mine['rank']} {_call([differ[0], *differ[1]])}, "
                     f"rank {other['rank']} {_call(theirs[differ[0]])}")
        else:
            first = f"the first differing call is call {other['totals'].get(group, 0) + 1}, which rank " \
                    f"{other['rank']} never issued"
        return (f"collective check: rank {mine['rank']} has waited {seconds:.0f} s in call {number} on group {group} "
                f"(ranks {', '.join(map(str, ranks))}): {call}; rank {other['rank']} issued "
                f"{other['totals'].get(group, 0)} calls on that group and {elsewhere}; {first}")
    return None
