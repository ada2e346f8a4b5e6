"""Open files for gloo's sockets (``parallel/mesh/open_files.py``): the soft limit rises toward the hard one before
the groups are made, never falls, and gloo running out of them is one line that names ``ulimit -n``."""

from __future__ import annotations

import resource
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from cp_train.errors import describe
from cp_train.parallel.mesh import open_files
from cp_train.parallel.mesh import state as parallel_state
from cp_train.parallel.mesh.collectives import explain_collective_failure
from cp_train.parallel.mesh.open_files import OTHER_OPEN_FILES, gloo_group_of_every_rank, raise_open_file_limit


def test_the_soft_limit_rises_to_what_the_sockets_need_and_never_falls() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 100 + OTHER_OPEN_FILES
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        expected = want if hard == resource.RLIM_INFINITY else min(want, hard)
        assert raise_open_file_limit(100) == (expected, want)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (expected, hard)
        high = 5 * want if hard == resource.RLIM_INFINITY else min(5 * want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (high, hard))
        assert raise_open_file_limit(100) == (high, want)  # already enough: left as it is
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (high, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hard_limit_below_the_need_is_as_far_as_it_rises(monkeypatch) -> None:
    limits = {"now": (64, 200)}
    fake = SimpleNamespace(RLIMIT_NOFILE=resource.RLIMIT_NOFILE, RLIM_INFINITY=resource.RLIM_INFINITY,
                           getrlimit=lambda kind: limits["now"],
                           setrlimit=lambda kind, values: limits.update(now=values))
    monkeypatch.setattr(open_files, "resource", fake)
    assert raise_open_file_limit(open_files.sockets_for(1024)) == (200, 2 * 1023 + OTHER_OPEN_FILES)
    assert limits["now"] == (200, 200)


def test_every_initialisation_asks_for_the_sockets_of_its_world(monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(parallel_state, "raise_open_file_limit", asked.append)
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setattr(parallel_state, "init_default_group", lambda backend, timeout: (_ for _ in ()).throw(
        RuntimeError("stop before any group")))
    with pytest.raises(RuntimeError, match="stop before any group"):
        parallel_state.initialize_parallel(tp=8, cp=16)
    assert asked == [open_files.sockets_for(1024)] == [2046]


def test_running_out_of_open_files_is_one_line_naming_the_limit(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1024")
    def out_of_files(**kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:123] socket: Too many open files")

    monkeypatch.setattr(dist, "new_group", out_of_files)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1024)
    line = r"^ran out of open files connecting gloo's group over 1024 ranks: .*about 3070 open files .*\(ulimit -n\)"
    with pytest.raises(RuntimeError, match=line) as got:
        gloo_group_of_every_rank(timedelta(minutes=1))
    # the commands print it as the rank's line, not as an unexpected error with its place in the code
    assert describe(got.value, explain_collective_failure) == (f"rank 3: {got.value}", 1, True)

    def refused(**kwargs):
        raise RuntimeError("Connection refused")

    monkeypatch.setattr(dist, "new_group", refused)
    with pytest.raises(RuntimeError, match="^Connection refused$"):  # any other failure as it was
        gloo_group_of_every_rank(timedelta(minutes=1))
