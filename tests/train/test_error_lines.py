"""The pieces behind the one-line failures, in-process: describing an exception, explaining a failed
collective, torchrun's failure summary, the resume rules, metrics after a resume, pruning checkpoints."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cp_train.checkpoint.files import DCP_METADATA, LATEST, META, prune, resume_source, step_dir_name
from cp_train.checkpoint.resume import check_resume, config_changes
from cp_train.cli.launch import summarize
from cp_train.config.schema import ConfigError
from cp_train.config.sources import build_config
from cp_train.errors import InputError, RunFailure, describe, ensure_writable_dir
from cp_train.metrics.writers import drop_records_after
from cp_train.parallel.dp import ddp as data_parallel
from cp_train.parallel.mesh import collectives


@pytest.fixture()
def world_of(monkeypatch):
    def set_world(rank: int, size: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(size))
    return set_world


def test_describe_reports_once_or_per_rank(world_of) -> None:
    world_of(1, 2)
    assert describe(ConfigError("train.steps must be >= 1")) == ("train.steps must be >= 1", 2, False)
    failure = RunFailure("disk gone")
    failure.everywhere = False
    assert describe(failure) == ("rank 1: disk gone", 1, True)
    try:
        {}["missing"]
    except KeyError as error:
        line, code, here = describe(error)
    assert (code, here) == (1, True)
    assert line.startswith("rank 1: unexpected KeyError: 'missing' (at test_error_lines.py:")
    assert line.endswith("rerun with --debug or CP_TRAIN_DEBUG=1 for the traceback)")
    world_of(0, 1)
    assert describe(ValueError("a\nb"))[0].startswith("unexpected ValueError: a (at ")


def test_collective_failures_name_operation_group_and_timeout(monkeypatch) -> None:
    monkeypatch.setitem(collectives._settings, "timeout_minutes", 0.5)
    group = object()
    monkeypatch.setitem(collectives._labels, id(group), ["cp", "dp_cp"])
    monkeypatch.setitem(collectives._ranks, id(group), (2, 3))
    timeout = RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv "
                           "operation to complete")
    collectives.note_failure(timeout, "all_reduce", group)
    assert collectives.explain_collective_failure(timeout) == (
        "all_reduce on the cp group (ranks 2, 3; also dp_cp here) timed out after 0.5 min "
        "(parallel.timeout_minutes=0.5): another rank of the group stopped taking part (hung or stopped: look at "
        "its output) or is slower than that (raise parallel.timeout_minutes) (Timed out waiting 30000ms for recv "
        "operation to complete)")
    lost = RuntimeError("Connection closed by peer [10.0.0.2]:5000. More text")
    assert collectives.explain_collective_failure(lost) == (
        "a collective failed: another rank of the group went away (killed, or failed: see its message) "
        "(Connection closed by peer [10.0.0.2]:5000)")
    assert collectives.explain_collective_failure(RuntimeError("shape mismatch")) is None
    assert collectives.explain_collective_failure(ValueError("timed out")) is None


def test_the_rings_dk_dv_twin_and_the_other_optional_groups_are_named(monkeypatch) -> None:
    """A dK/dV hop timing out on the ring's twin communicator is named as the CP group's (it was "group undefined",
    seen once when a hung rank stopped its peer mid-hop); the hybrid's and HSDP's groups by their own roles."""
    from types import SimpleNamespace

    monkeypatch.setattr(collectives, "_labels", {})
    monkeypatch.setattr(collectives, "_ranks", {})
    monkeypatch.setattr(collectives, "_world", [])
    axis = lambda ranks: SimpleNamespace(group=object(), ranks=ranks)  # noqa: E731
    dp_cp = axis((0, 1))
    state = SimpleNamespace(tp=axis((0,)), cp=axis((0, 1)), dp=axis((0,)), dp_cp=dp_cp, tp_cp=axis((0, 1)),
                            cp_grad=axis((0, 1)), cp_ulysses=None, cp_ring=axis((0, 1)), fsdp_shard=dp_cp,
                            dp_replicate_axis=axis((0, 2)), world_size=2)
    collectives.label_groups(state)
    assert collectives.group_name(state.cp_grad.group) == "the cp group (ranks 0, 1)"
    assert collectives.group_name(state.cp_ring.group) == "the cp_ring group (ranks 0, 1)"
    assert collectives.group_name(state.dp_replicate_axis.group) == "the dp_replicate group (ranks 0, 2)"
    assert collectives.group_name(dp_cp.group) == "the dp_cp group (ranks 0, 1)"  # FSDP's is dp_cp's own


def test_a_failure_on_the_default_group_is_named_after_the_groups_are_destroyed(monkeypatch) -> None:
    """``dist.all_reduce(x)`` (group None) timed out; the entry point explains it after ``parallel_context`` has
    destroyed the default group (``dist.group.WORLD`` is None then): still the world group, not ``group ?``."""
    monkeypatch.setitem(collectives._settings, "timeout_minutes", 0.05)
    world = object()
    monkeypatch.setattr(collectives, "_world", [world])
    monkeypatch.setitem(collectives._labels, id(world), ["world"])
    monkeypatch.setitem(collectives._ranks, id(world), (0, 1))
    assert dist.group.WORLD is None  # no default group in this process
    timeout = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    collectives.note_failure(timeout, "all_reduce", None)
    assert collectives.explain_collective_failure(timeout).startswith(
        "all_reduce on the world group (ranks 0, 1) timed out after 0.05 min (parallel.timeout_minutes=0.05)")
    assert collectives.group_name(object()) == "group object"  # an unknown group: its type, never "?"


def test_a_failed_ddp_reduction_names_its_collective_though_ddp_rewraps_the_error(monkeypatch) -> None:
    """DDP waits on its comm hook's future in C++ and raises a new error ("Got the following error when running
    the callback: ..."): the hook records which collective failed, so the one line still names it."""
    monkeypatch.setitem(collectives._settings, "timeout_minutes", 0.05)
    monkeypatch.setattr(collectives, "_last_failure", [])
    group = object()
    monkeypatch.setitem(collectives._labels, id(group), ["dp_cp"])
    monkeypatch.setitem(collectives._ranks, id(group), (0, 1))
    failed = torch.futures.Future()
    failed.set_exception(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    work = SimpleNamespace(get_future=lambda: failed)
    monkeypatch.setattr(data_parallel.dist, "all_reduce", lambda *args, **kwargs: work)
    bucket = SimpleNamespace(buffer=lambda: torch.zeros(4))
    with pytest.raises(RuntimeError) as raised:
        data_parallel._sum_all_reduce(group, bucket).wait()
    assert getattr(raised.value, collectives._TAG, None) is None  # a new exception, not the one the hook saw
    assert collectives.explain_collective_failure(raised.value) == (
        "all_reduce on the dp_cp group (ranks 0, 1) timed out after 0.05 min (parallel.timeout_minutes=0.05): "
        "another rank of the group stopped taking part (hung or stopped: look at its output) or is slower than "
        "that (raise parallel.timeout_minutes) (Timed out waiting 3000ms for recv operation to complete)")


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="<N/A>")
    failure.timestamp = timestamp
    return failure


def test_launch_summary_names_the_root_cause_and_its_exit_code() -> None:
    killed = ChildFailedError("/repo/train.py", {0: _failure(0, -signal.SIGTERM, 5), 1: _failure(1, -9, 6)})
    assert summarize(killed) == ("cp_train.cli.launch: train.py failed with exit code 137 (killed by SIGTERM on "
                                 "rank 0; killed by SIGKILL on rank 1)", 137)
    config = ChildFailedError("train.py", {0: _failure(0, 2, 7), 1: _failure(1, -signal.SIGTERM, 6),
                                           2: _failure(2, 2, 7)})
    assert summarize(config) == ("cp_train.cli.launch: train.py failed with exit code 2 (exit code 2 on ranks 0, 2; "
                                 "killed by SIGTERM on rank 1)", 2)


def test_resume_refuses_data_and_model_changes_unless_allowed() -> None:
    saved = build_config([("t", {"train.global_batch_size": 8, "model.num_layers": 2})]).to_dict()
    changed = build_config([("t", {"train.global_batch_size": 16, "model.num_layers": 2, "train.steps": 500,
                                   "logging.interval": 3})])
    assert config_changes(saved, changed.to_dict()) == {"train.global_batch_size": (8, 16), "train.steps": (100, 500),
                                                        "logging.interval": (10, 3)}
    refused = r"^checkpoint ck was saved with another data stream or model: train\.global_batch_size 8 -> 16; "
    with pytest.raises(InputError, match=refused + r".*allow_changes=train\.global_batch_size$"):
        check_resume(saved, changed, "ck")
    changed.checkpoint.allow_changes = ["train.global_batch_size"]
    assert check_resume(saved, changed, "ck") == [
        "accepted changes since the checkpoint (checkpoint.allow_changes): train.global_batch_size 8 -> 16",
        "changed since the checkpoint: train.steps 100 -> 500"]
    # setting data.valid_prefix changes the training documents (none held out); renaming it does not
    with_valid = build_config([("t", {"data.valid_prefix": "data/held-out"})])
    with pytest.raises(InputError, match=r"data\.valid_prefix None -> 'data/held-out'; .*allow_changes=data\."):
        check_resume(build_config([]).to_dict(), with_valid, "ck")
    assert check_resume({**with_valid.to_dict(), "data": {**with_valid.to_dict()["data"], "valid_prefix": "v2"}},
                        with_valid, "ck") == ["changed since the checkpoint: data.valid_prefix 'v2' -> 'data/held-out'"]


def test_metrics_after_a_resume_drop_the_redone_steps(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 8)] + [{"kind": "eval", "step": 5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "st')  # killed mid-line
    assert drop_records_after(path, 4) == 5
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def _fake_checkpoint(root, step: int, complete: bool = True) -> None:  # noqa: ANN001
    directory = root / step_dir_name(step)
    directory.mkdir()
    if complete:  # complete as checkpoint_files sees it: meta.json, and DCP metadata naming no shard
        (directory / META).write_text(json.dumps({"step": step, "consumed_samples": 0, "layout": {},
                                                  "config": {}}))
        with open(directory / DCP_METADATA, "wb") as handle:
            pickle.dump(Metadata(state_dict_metadata={}, storage_data={}), handle)


def test_a_save_directory_without_latest_is_not_started_afresh(tmp_path) -> None:
    """Auto-resume finds no `latest` but complete checkpoints: starting afresh would mix two runs and prune the
    good ones, so the run stops with the --load to use."""
    _fake_checkpoint(tmp_path, 2, complete=False)
    assert resume_source(None, str(tmp_path)) is None  # only an interrupted first save: start afresh
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 6)
    (tmp_path / LATEST).write_text(step_dir_name(4))
    assert resume_source(None, str(tmp_path)) == tmp_path / step_dir_name(4)
    (tmp_path / LATEST).unlink()
    with pytest.raises(InputError, match=rf"holds checkpoints but no `latest`: resume from the newest complete one "
                                         rf"with --load {tmp_path / step_dir_name(6)}, or start a new run"):
        resume_source(None, str(tmp_path))
    assert resume_source(None, str(tmp_path / "new")) is None


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path) -> None:
    def checkpoint(step: int, complete: bool = True) -> None:
        _fake_checkpoint(tmp_path, step, complete)

    for step in (2, 4, 6):
        checkpoint(step)
    checkpoint(3, complete=False)  # an interrupted save
    checkpoint(8, complete=False)  # a save in progress or interrupted after the newest complete one
    (tmp_path / LATEST).write_text(step_dir_name(6))
    assert prune(tmp_path, keep=0) == []
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == [step_dir_name(2), step_dir_name(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST] + [step_dir_name(s) for s in (4, 6, 8)]
    assert os.path.isdir(tmp_path / step_dir_name(8))


def test_a_directory_checked_without_creating_it(tmp_path) -> None:
    """``ensure_writable_dir(create=False)`` checks the nearest folder that exists and makes nothing; a file on the
    way down, or the path itself a file, is one line naming the key."""
    ensure_writable_dir(tmp_path / "a" / "b", "--output-dir", create=False)
    assert list(tmp_path.iterdir()) == []
    ensure_writable_dir(tmp_path / "made", "--out")
    assert (tmp_path / "made").is_dir() and list((tmp_path / "made").iterdir()) == []
    (tmp_path / "file").write_text("x")
    for path, words in ((tmp_path / "file" / "sub", "is not a writable directory (Not a directory)"),
                        (tmp_path / "file", "is a file: pass a directory")):
        for create in (True, False):
            with pytest.raises(InputError, match=r"^--output-dir \S+ " + re.escape(words)):
                ensure_writable_dir(path, "--output-dir", create=create)
