"""The test suite's strict communication layer: gloo made to behave as NCCL, and every job's collectives checked.

NCCL ignores point-to-point tags and pairs the k-th send from a to b on a communicator with the k-th receive at
b from a; a size mismatch hangs or fills part of a buffer. gloo pairs by tag. Installed in every rank of a spawned
world (``tests/conftest.py``), this layer:

- replaces each message's tag by its place in its channel (group, sender, receiver), so gloo pairs the k-th send
  with the k-th receive as NCCL does (a reordered pair that tags would have hidden now crosses over);
- records every rank's collectives and messages (``cp_train.parallel.mesh.trace``) and checks them after the job:
  the same sequence with the same sizes on every member of a group, every send received into a buffer of its
  dtype and shape (``check``). A receive buffer larger than its send (gloo fills part of it) and a same-sized
  collective in another order (gloo pairs them silently) fail the job there; a smaller receive buffer or a
  collective of another size makes gloo abort the rank ("ranks [r] died", gloo's enforce message on stderr).

With ``CP_TRAIN_STRICT_DECLARE=1`` in the ranks' environment it also declares each message and collective in the
store before issuing it, so those failures become an ``AssertionError`` at the call instead of an abort: each
receive checked against its send's dtype and shape before it is posted, each collective against the group's
first member's call at the same place. One store round trip per call makes a 4-rank training job about 30% slower
on 2 cores (``python -m bench.suite_costs``), so the suite's shared worlds leave it off and the layer's own tests
turn it on; set it to find where a world died.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from cp_train.parallel.mesh import trace

DECLARE = "CP_TRAIN_STRICT_DECLARE"  # "1": declare every call in the store before it is issued
WAIT = timedelta(seconds=60)  # how long a receive or a collective waits for its peer's declaration
_channels: Counter[tuple[str, int, int]] = Counter()  # messages posted per (group, sender, receiver), ever
_calls: Counter[str] = Counter()  # collectives issued per group
_job = [0]
_installed = [False]


def _store() -> dist.Store:
    return c10d._get_default_store()


def _declare_message(sending: bool, key: str, what: str, place: int, peer: int, name: str) -> None:
    """A send names its buffer in the store; a receive waits for that and compares it with its own buffer."""
    if sending:
        _store().set(key, what)
        return
    me = dist.get_rank()
    try:
        sent = _store().get(key).decode()  # waits for the key, up to WAIT (the store's timeout, ``install``)
    except RuntimeError:
        raise AssertionError(f"rank {me}: receive {place} from rank {peer} on group {name} has no send "
                             f"{place} from rank {peer} within {WAIT.seconds} s") from None
    assert sent == what, (f"rank {me}: receive {place} from rank {peer} on group {name} posts a {what} buffer "
                          f"but send {place} of rank {peer} is {sent} (NCCL pairs them in order, ignoring tags)")


def _ordered(kind: str, fn: Callable[..., Any], declare: bool) -> Callable[..., Any]:
    """``isend``/``irecv`` with the tag replaced by the message's place in its channel; with ``declare`` the
    receive is checked against the send's declaration before it is posted."""
    sending = kind == "isend"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        group, peer, tensor = trace.peer_of(kind, args, kwargs, fn)
        name = (group if group is not None else c10d._get_default_group()).group_name
        me = dist.get_rank()
        channel = (name, me, peer) if sending else (name, peer, me)
        _channels[channel] += 1
        place = _channels[channel]
        if declare:
            key = f"strict/{_job[0]}/p2p/{name}/{channel[1]}/{channel[2]}/{place}"
            _declare_message(sending, key, trace._describe([tensor]), place, peer, name)
        kwargs = {**kwargs, "tag": place % (1 << 30)}
        names = trace._parameters(fn)
        if "tag" in names and names.index("tag") < len(args):
            args = args[:names.index("tag")] + args[names.index("tag") + 1:]  # tag passed by keyword instead
        return fn(*args, **kwargs)

    call.__strict__ = True  # type: ignore[attr-defined]
    return call


def _sends_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_isend_irecv`` posting its sends before its receives (the batch's order means nothing, and a
    receive waits for its send's declaration)."""
    @functools.wraps(fn)
    def call(p2p_op_list: list[dist.P2POp]) -> Any:
        sends = [op for op in p2p_op_list if op.op is c10d.isend]
        return fn(sends + [op for op in p2p_op_list if op.op is not c10d.isend])

    return call


def _checked(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A collective compared with the group's first member's call at the same place before it is issued."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        group = trace._group_of(kind, args, kwargs, fn)
        group = group if group is not None else c10d._get_default_group()
        members = dist.get_process_group_ranks(group)
        if len(members) > 1 and not trace.TRACE.paused:
            name = group.group_name
            _calls[name] += 1
            me, first = dist.get_rank(), members[0]
            mine = trace._call_of(kind, args, kwargs, fn)
            prefix = f"strict/{_job[0]}/coll/{name}/{_calls[name]}"
            _store().set(f"{prefix}/{me}", f"{mine.kind} {mine.what}|{mine.site}")
            other = members[1] if me == first else first
            try:
                theirs, site = _store().get(f"{prefix}/{other}").decode().split("|")  # waits, up to WAIT
            except RuntimeError:
                raise AssertionError(f"rank {me}: collective {_calls[name]} on group {name} ({mine}) has no "
                                     f"counterpart on rank {other} within {WAIT.seconds} s") from None
            assert theirs == f"{mine.kind} {mine.what}", (
                f"collective {_calls[name]} on group {name} differs: rank {me} issues {mine}, rank {other} "
                f"issues {theirs} at {site}")
        return fn(*args, **kwargs)

    call.__strict__ = True  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Make this process's ``torch.distributed`` strict (idempotent; after ``init_process_group``): NCCL's pairing
    and the records always, the declarations with ``CP_TRAIN_STRICT_DECLARE=1``."""
    if _installed[0]:
        return
    _installed[0] = True
    declare = os.environ.get(DECLARE) == "1"
    trace.record()
    for kind in ("isend", "irecv"):
        wrapped = _ordered(kind, getattr(dist, kind), declare)
        setattr(dist, kind, wrapped)
        setattr(c10d, kind, wrapped)
    dist.batch_isend_irecv = c10d.batch_isend_irecv = _sends_first(c10d.batch_isend_irecv)
    if not declare:
        return
    _store().set_timeout(WAIT)  # a declaration's get waits this long (one round trip: no wait before it)
    for kind in trace.SYMMETRIC + trace.UNEVEN:
        fn = getattr(dist, kind, None)
        if fn is not None and kind not in ("all_gather_object", "gather_object", "scatter_object_list",
                                          "broadcast_object_list"):
            wrapped = _checked(kind, fn)
            setattr(dist, kind, wrapped)
            if getattr(c10d, kind, None) is fn:
                setattr(c10d, kind, wrapped)


def after_job() -> dict[str, Any]:
    """What this rank recorded during the job (``Trace.take``); the next job starts fresh."""
    _job[0] += 1
    _calls.clear()  # messages keep counting: a tag is never used twice in a world
    return trace.TRACE.take()


def check(records: list[dict[str, Any]]) -> str | None:
    """The first difference between the ranks' records of one job, in one line (None: they agree)."""
    return trace.check_records(dict(enumerate(records)))
