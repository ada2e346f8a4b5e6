"""The open files a rank needs for gloo's sockets over every rank, and the one-line error where it cannot have them.

A gloo group connects one socket to each of its peers when it is made. The trainer keeps gloo groups over every
rank (the host's group; a second one for checkpoints written behind training), so at 1,024 ranks each rank holds
about 2,046 sockets beside its other files, where Linux's usual soft limit on open files (``ulimit -n``) is 1,024
and its hard limit is far higher. ``raise_open_file_limit`` raises the soft limit toward the hard one before the
groups are made, as it can without privileges; ``gloo_group_of_every_rank`` makes such a group and turns gloo's
"Too many open files" into a line that says what to change where the hard limit is lower still.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

try:
    import resource
except ImportError:  # not POSIX: no limit to read or raise
    resource = None  # type: ignore[assignment]

OTHER_OPEN_FILES = 1024  # what a rank keeps open beside gloo's sockets: datasets, NCCL and CUDA, Python's own
GLOO_GROUPS_OVER_EVERY_RANK = 2  # the host's group and the background checkpoint's


def sockets_for(world: int) -> int:
    """The sockets a rank's gloo groups over every rank of a ``world`` hold."""
    return GLOO_GROUPS_OVER_EVERY_RANK * max(world - 1, 0)


def raise_open_file_limit(sockets: int) -> tuple[int, int] | None:
    """Raise this process's soft limit on open files to hold ``sockets`` beside ``OTHER_OPEN_FILES``, up to its hard
    limit (never lower it); (the soft limit now, what was wanted), or None where the platform has no such limit."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = sockets + OTHER_OPEN_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return (want if soft == resource.RLIM_INFINITY else soft), want


class OpenFilesExhausted(RuntimeError):
    """gloo ran out of open files while connecting a group; the message says what to change (the commands print it
    as the rank's one line: ``collectives.explain_collective_failure``)."""


def gloo_group_of_every_rank(timeout: timedelta) -> dist.ProcessGroup:
    """A new gloo group of every rank (collective); running out of open files is a line that says what to change."""
    try:
        return dist.new_group(timeout=timeout, backend="gloo")
    except RuntimeError as error:
        named = _named_open_file_error(error, dist.get_world_size())
        if named is None:
            raise
        raise named from None


def _named_open_file_error(error: BaseException, world: int) -> OpenFilesExhausted | None:
    """The one-line error for ``error`` if it is gloo running out of open files while connecting ``world`` ranks
    (errno 24), else None."""
    if "Too many open files" not in str(error):
        return None
    limits = resource.getrlimit(resource.RLIMIT_NOFILE) if resource is not None else None
    now = f" (now {limits[0]}, hard limit {limits[1]})" if limits else ""
    return OpenFilesExhausted(
        f"ran out of open files connecting gloo's group over {world} ranks: each rank needs a socket per peer, about "
        f"{sockets_for(world) + OTHER_OPEN_FILES} open files at this size{now}; raise the limit on open files "
        f"(ulimit -n) in the job script or ask the cluster's admins")
