"""Naming the collective a rank was in when it failed: a timeout, or a peer that went away.

gloo's errors name neither the operation nor the group ("Timed out waiting 180000ms for recv operation
to complete"), and torch's flight recorder does not record gloo's point-to-point ops (the CP ring).
``trace_collectives(state, timeout_minutes)``, called once by the entry point, wraps the
``torch.distributed`` collectives and ``Work.wait`` so that an exception raised by one of them carries
``(operation, group)``; ``explain_collective_failure(error)`` turns it into one line naming the operation,
the group by its role (tp, cp, dp, dp_cp, tp_cp, world) and ``parallel.timeout_minutes``.

The wrappers cost one Python call per collective and keep no tensors alive (in-flight ``Work`` objects
are held weakly). With nccl, a timeout is caught by NCCL's watchdog, which aborts the process itself;
its message names the operation (``OpType``) and the group's mesh dimension (``mesh_cp``, ...).
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from cp_train.parallel.mesh.open_files import OpenFilesExhausted
from cp_train.parallel.mesh.state import ParallelState

TRACED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
          "all_gather_single", "reduce_scatter_single",
          "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter", "barrier",
          "monitored_barrier", "send", "recv", "batch_isend_irecv", "all_gather_object",
          "broadcast_object_list", "gather_object", "scatter_object_list")
# isend / irecv stay unwrapped: P2POp checks its op by identity; batch_isend_irecv carries their group.
TIMEOUT_MARKERS = ("timed out", "timeout")
PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                     "connection refused", "socket closed", "read error", "write error")
_TAG = "_cp_train_collective"
# a future's then() wraps its callback's error: "Got the following error ...: RuntimeError: <text> At: <traceback>"
_CALLBACK_WRAPPER = re.compile(r"^Got the following error when running the callback: \w+: (.*?)(?: At: .*)?$")
_BACKEND_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")  # "[/.../unbound_buffer.cc:129] "

_labels: dict[int, list[str]] = {}  # id(process group) -> its roles, e.g. ["cp", "dp_cp"]
_ranks: dict[int, tuple[int, ...]] = {}
_in_flight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Work -> (operation, group)
_settings: dict[str, float] = {}
_world: list[Any] = []  # the default group when the trace started: None names it after it is destroyed
_last_failure: list[tuple[str, str, Any]] = []  # the latest (message, operation, group) that failed
_installed = False


def _p2p_group(args: tuple, kwargs: dict) -> Any:
    ops = args[0] if args else kwargs.get("p2p_op_list", [])
    return ops[0].group if ops else None


def _group_argument(name: str, fn: Callable[..., Any]) -> Callable[[tuple, dict], Any]:
    """A function returning the process group a call of ``fn`` addresses (None: the default group)."""
    if name == "batch_isend_irecv":
        return _p2p_group
    names = list(inspect.signature(fn).parameters)
    index = names.index("group") if "group" in names else None
    return lambda args, kwargs: kwargs.get("group", args[index] if index is not None and index < len(args)
                                           else None)


def note_failure(error: BaseException, operation: str, group: Any) -> None:
    """Record that ``operation`` on ``group`` raised ``error``: on the error itself, and as the latest failure
    (for a future's callback, DDP's comm hook, whose error reaches the caller re-wrapped in a new exception)."""
    _last_failure[:] = [(str(error), operation, group)]
    if getattr(error, _TAG, None) is None:
        try:
            setattr(error, _TAG, (operation, group))
        except AttributeError:
            pass


def _traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    group_of = _group_argument(name, fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except Exception as error:
            note_failure(error, name, group_of(args, kwargs))
            raise
        works = result if isinstance(result, list) else [result]
        for work in works:
            if isinstance(work, dist.Work):
                _in_flight[work] = (name, group_of(args, kwargs))
        return result

    call.__wrapped_collective__ = fn  # type: ignore[attr-defined]
    return call


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    for name in TRACED:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__wrapped_collective__"):
            setattr(dist, name, _traced(name, fn))
    original_wait = dist.Work.wait

    def wait(self: dist.Work, *args: Any, **kwargs: Any) -> Any:
        try:
            return original_wait(self, *args, **kwargs)
        except Exception as error:
            found = _in_flight.get(self)
            if found is not None:
                note_failure(error, *found)
            raise

    dist.Work.wait = wait


# groups a state may also hold, by attribute: the role each is named by (the ring's dK/dV twin is a second
# communicator over the CP ranks: a hop timing out there is named as the CP group's)
_OPTIONAL_ROLES = {"cp_grad": "cp", "cp_ulysses": "cp_ulysses", "cp_ring": "cp_ring", "fsdp_shard": "fsdp_shard",
                   "dp_replicate_axis": "dp_replicate"}


def label_groups(state: ParallelState) -> None:
    """Name ``state``'s groups by role (``group_name``): tp, cp, dp, dp_cp, tp_cp, the world, and the optional
    groups (``_OPTIONAL_ROLES``) that are objects of their own."""
    _labels.clear()
    _ranks.clear()
    for role in ("tp", "cp", "dp", "dp_cp", "tp_cp"):
        axis = getattr(state, role)
        _labels.setdefault(id(axis.group), []).append(role)
        _ranks[id(axis.group)] = axis.ranks
    for attr, role in _OPTIONAL_ROLES.items():
        axis = getattr(state, attr, None)
        if axis is not None and axis.group is not None and id(axis.group) not in _labels:
            _labels[id(axis.group)] = [role]
            _ranks[id(axis.group)] = axis.ranks
    world = dist.group.WORLD
    _world[:] = [world]
    _labels.setdefault(id(world), []).append("world")
    _ranks[id(world)] = tuple(range(state.world_size))


def trace_collectives(state: ParallelState, timeout_minutes: float) -> None:
    """Name ``state``'s groups by role and tag failing collectives from now on (idempotent)."""
    label_groups(state)
    _settings["timeout_minutes"] = timeout_minutes
    _install()


def group_name(group: Any) -> str:
    """``the cp group (ranks 0, 1)``; groups the trace does not know by their torch description. None is the
    default group, also once it is destroyed (an error is explained after the groups are torn down)."""
    if group is None:
        group = _world[0] if _world else dist.group.WORLD
    key = id(group)
    roles = _labels.get(key)
    if roles:
        also = f"; also {', '.join(roles[1:])} here" if len(roles) > 1 else ""
        ranks = _ranks.get(key, ())
        return f"the {roles[0]} group (ranks {', '.join(map(str, ranks))}{also})"
    return f"group {getattr(group, 'group_desc', None) or getattr(group, 'group_name', None) or type(group).__name__}"


def _wrapped_failure(text: str) -> tuple[str | None, Any]:
    """(operation, group) of the latest recorded failure when ``text`` quotes its message."""
    if _last_failure and _last_failure[0][0] and _last_failure[0][0] in text:
        return _last_failure[0][1:]
    return None, None


def explain_collective_failure(error: BaseException) -> str | None:
    """One line for a collective that timed out or lost a peer, or a gloo group that ran out of open files; None for
    any other error."""
    if isinstance(error, OpenFilesExhausted):  # its message is the line
        return str(error)
    text = " ".join(str(error).split())
    lower = text.lower()
    timeout, lost = any(m in lower for m in TIMEOUT_MARKERS), any(m in lower for m in PEER_LOST_MARKERS)
    if not (timeout or lost) or not isinstance(error, RuntimeError):
        return None
    operation, group = getattr(error, _TAG, None) or _wrapped_failure(str(error))
    where = f"{operation} on {group_name(group)}" if operation else "a collective"
    backend_text = _CALLBACK_WRAPPER.sub(r"\1", _BACKEND_LOCATION.sub("", text))
    detail = f"({backend_text.split('. ')[0][:160]})"  # the backend's first sentence
    minutes = _settings.get("timeout_minutes")
    if timeout:
        limit = f"{minutes:g} min (parallel.timeout_minutes={minutes:g})" if minutes else "parallel.timeout_minutes"
        return (f"{where} timed out after {limit}: another rank of the group stopped taking part (hung or "
                f"stopped: look at its output) or is slower than that (raise parallel.timeout_minutes) {detail}")
    return f"{where} failed: another rank of the group went away (killed, or failed: see its message) {detail}"
