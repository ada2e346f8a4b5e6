"""Every rank's sequence of collectives per process group, recorded where ``torch.distributed`` is called.

NCCL pairs the k-th send from a to b on a communicator with the k-th receive at b from a, whatever the tags,
and needs every member of a group to issue its collectives in the same order with the same sizes; a mismatch
hangs or silently pairs the wrong buffers. gloo matches point-to-point messages by tag and hides such bugs, so
the order is checked instead: ``record()`` wraps the ``torch.distributed`` collectives (those FSDP2 calls
included) and point-to-point calls and appends, per group, one ``Call`` (its kind, dtype, sizes and the
caller's place in the code) to this process's ``TRACE``. ``first_difference`` compares the members' records of
one group; ``check_records`` names the first difference of a world's records in one line, for the run-time check
(``collective_check.py``, ``parallel.check_collectives``) and the test suite's strict layer
(``tests/strict_comm.py``), which checks them after every job of a spawned world.

Not seen: collectives issued below the Python API (DDP's bucket all-reduces, functional collectives of compiled
code), which PyTorch issues in a fixed order itself.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

SYMMETRIC = ("all_reduce", "broadcast", "reduce", "barrier", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter_tensor", "reduce_scatter_single", "all_gather", "reduce_scatter")
UNEVEN = ("all_to_all_single", "all_to_all", "gather", "scatter", "all_gather_object", "broadcast_object_list",
          "gather_object", "scatter_object_list")
POINT_TO_POINT = ("isend", "irecv", "send", "recv")
_SKIP_FRAMES = ("torch/distributed", "parallel/mesh/trace.py", "parallel/mesh/collectives.py", "tests/strict_comm.py",
                "functools.py")


@dataclass(frozen=True)
class Call:
    """One collective as a rank issued it: ``kind``; ``what``: the dtype and sizes every member must agree on (for a
    point-to-point call: direction, peer and shape); ``site``: file:line of the caller."""

    kind: str
    what: str
    site: str

    def __str__(self) -> str:
        return f"{self.kind} {self.what} at {self.site}"


class Trace:
    """This process's collectives per group (key: the group's name, the same on every member), its point-to-point
    messages per (group, sender, receiver) (global ranks; the buffers' dtype and shape), and the members."""

    RECENT = 64  # calls per group kept with their place for a stall report (``recent``)

    def __init__(self) -> None:
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self.messages: dict[tuple[str, int, int, str], list[str]] = defaultdict(list)  # (group, src, dst, side)
        self.members: dict[str, tuple[int, ...]] = {}
        self.paused = 0
        self.totals: dict[str, int] = defaultdict(int)  # calls ever issued per group
        self.recent: dict[str, deque[tuple[int, Call]]] = defaultdict(lambda: deque(maxlen=self.RECENT))
        self.waiting: tuple[str, int, Call, float] | None = None  # (group, call number, call, since) while blocked

    def _name(self, group: Any) -> str:
        group = group if group is not None else c10d._get_default_group()
        name = group.group_name
        if name not in self.members:
            self.members[name] = tuple(dist.get_process_group_ranks(group))
        return name

    def add(self, group: Any, call: Call) -> tuple[str, int] | None:
        """Record ``call`` on ``group``; returns (the group's name, the call's number on it), None while paused."""
        if self.paused:
            return None
        name = self._name(group)
        self.calls[name].append(call)
        self.totals[name] += 1
        self.recent[name].append((self.totals[name], call))
        return name, self.totals[name]

    def add_message(self, group: Any, src: int, dst: int, side: str, what: str) -> None:
        """A send (``side`` "send", recorded by ``src``) or a receive ("recv", by ``dst``) of a ``what`` buffer."""
        if not self.paused:
            self.messages[(self._name(group), src, dst, side)].append(what)

    def take(self) -> dict[str, Any]:
        """What was recorded since the last ``take`` (and the members of the groups); the record restarts."""
        taken = {"calls": {name: list(calls) for name, calls in self.calls.items()},
                 "messages": {key: list(what) for key, what in self.messages.items()}, "members": dict(self.members)}
        self.calls.clear()
        self.messages.clear()
        return taken


TRACE = Trace()
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _site() -> str:
    """The caller's ``folder/file.py:line``: past torch's and this layer's frames, and past the thin wrappers a
    module names in its ``COLLECTIVE_HELPERS`` (``parallel/compat.py``'s renames, ``max_over_ranks``)."""
    frame = sys._getframe(2)
    while frame is not None and (
            any(part in frame.f_code.co_filename.replace("\\", "/") for part in _SKIP_FRAMES)
            or frame.f_code.co_name in frame.f_globals.get("COLLECTIVE_HELPERS", ())):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.replace("\\", "/")
    return f"{'/'.join(path.split('/')[-2:])}:{frame.f_lineno}"


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_of(kind: str, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    names = list(_parameters(fn))
    return args[names.index("group")] if "group" in names and names.index("group") < len(args) else None


@functools.cache
def _parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(fn).parameters)


def peer_of(kind: str, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> tuple[Any, int, torch.Tensor]:
    """(group, the peer's global rank, the tensor) of a point-to-point call of ``fn`` with these arguments."""
    bound = {**dict(zip(_parameters(fn), args, strict=False)), **kwargs}
    group = bound.get("group")
    peer = bound.get("dst", bound.get("src"))
    local = bound.get("group_dst", bound.get("group_src"))
    if peer is None and local is not None:
        peer = dist.get_global_rank(group if group is not None else c10d._get_default_group(), local)
    return group, int(peer), bound["tensor"]


def _record_message(kind: str, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> None:
    group, peer, tensor = peer_of(kind, args, kwargs, fn)
    me = dist.get_rank()
    sending = kind in ("isend", "send")
    TRACE.add_message(group, me if sending else peer, peer if sending else me, "send" if sending else "recv",
                      _describe([tensor]))


def _call_of(kind: str, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> Call:
    if kind in UNEVEN:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in _tensors(args) + _tensors(kwargs)})
        return Call(kind, "/".join(dtypes), _site())
    shown = _tensors(args[:2]) if kind not in ("all_reduce", "broadcast", "reduce") else _tensors(args[:1])
    return Call(kind, _describe(shown or _tensors(kwargs.get("tensor"))), _site())


def _recording(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kind in POINT_TO_POINT:
            _record_message(kind, args, kwargs, fn)
            return fn(*args, **kwargs)
        recorded = _call_of(kind, args, kwargs, fn)
        place = TRACE.add(_group_of(kind, args, kwargs, fn), recorded)
        if place is None or kwargs.get("async_op"):
            return fn(*args, **kwargs)
        TRACE.waiting = (*place, recorded, time.monotonic())  # blocked in it until it returns
        try:
            return fn(*args, **kwargs)
        finally:
            TRACE.waiting = None

    call.__recorded_collective__ = fn  # type: ignore[attr-defined]
    return call


def record() -> None:
    """Start recording this process's collectives into ``TRACE`` (idempotent). Point-to-point calls are
    wrapped under both names PyTorch looks them up by (``P2POp`` checks its op by identity)."""
    for kind in SYMMETRIC + UNEVEN + POINT_TO_POINT:
        fn = getattr(dist, kind, None)
        if fn is None or hasattr(fn, "__recorded_collective__"):
            continue
        _ORIGINAL[kind] = fn
        wrapped = _recording(kind, fn)
        setattr(dist, kind, wrapped)
        if getattr(c10d, kind, None) is fn:
            setattr(c10d, kind, wrapped)


def first_difference(records: dict[int, list[Call]]) -> tuple[int, dict[int, Call | None]] | None:
    """(the index of the first call the members of one group disagree on, each rank's call there: None where it
    issued no more), or None when they agree; ``records``: rank -> its calls on the group."""
    longest = max((len(calls) for calls in records.values()), default=0)
    for index in range(longest):
        here = {rank: calls[index] if index < len(calls) else None for rank, calls in records.items()}
        if len({(c.kind, c.what) if c is not None else None for c in here.values()}) > 1:
            return index, here
    return None


def unpaired_message(taken: dict[int, dict[str, Any]]) -> str | None:
    """One line for the first message whose sends and receives do not pair in order (NCCL's rule: the k-th send
    from a to b on a group with the k-th receive at b from a, the same dtype and shape), or None."""
    channels = {key[:3] for record in taken.values() for key in record["messages"]}
    for group, src, dst in sorted(channels):
        sent = taken.get(src, {"messages": {}})["messages"].get((group, src, dst, "send"), [])
        received = taken.get(dst, {"messages": {}})["messages"].get((group, src, dst, "recv"), [])
        for index in range(max(len(sent), len(received))):
            a = sent[index] if index < len(sent) else "nothing"
            b = received[index] if index < len(received) else "nothing"
            if a != b:
                return (f"point-to-point message {index + 1} from rank {src} to rank {dst} on group {group} does not "
                        f"pair: rank {src} sent {a}, rank {dst} received into {b} (NCCL pairs them in order, "
                        f"ignoring tags)")
    return None


def describe_difference(group: str, members: tuple[int, ...], index: int, here: dict[int, Call | None]) -> str:
    """One line naming the group, the call and what each rank issued there."""
    issued = "; ".join(f"rank {rank}: {call if call is not None else 'nothing (it issued fewer)'}"
                       for rank, call in sorted(here.items()))
    return (f"the ranks' collectives on group {group} (ranks {', '.join(map(str, members))}) differ at call "
            f"{index + 1}: {issued}")


def check_records(taken: dict[int, dict[str, Any]]) -> str | None:
    """The first difference, in one line, between the records ``taken`` (rank -> ``Trace.take()``) of every rank
    of a world; None when every group's members agree."""
    members: dict[str, tuple[int, ...]] = {}
    for record in taken.values():
        members.update(record["members"])
    for group, ranks in members.items():
        present = [rank for rank in ranks if rank in taken]
        found = first_difference({rank: taken[rank]["calls"].get(group, []) for rank in present})
        if found is not None:
            return describe_difference(group, ranks, *found)
    return unpaired_message(taken)
