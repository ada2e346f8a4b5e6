"""Initialising the parallel state from a launcher's environment: size and timeout errors before any group, the
default group bound to the local GPU under NCCL, torchrun's variables, every group's timeout, and the default group
destroyed with the state when the state created it."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cp_train.parallel.mesh import groups as process_groups
from cp_train.parallel.mesh import state as ps
from cp_train.parallel.mesh.state import initialize_parallel
from cp_train.parallel.spawn import free_port


def test_initialize_rejects_size_below_one_before_touching_dist() -> None:
    with pytest.raises(ValueError, match="cp must be an integer >= 1, got 0"):
        initialize_parallel(tp=1, cp=0)
    assert not dist.is_initialized()


def test_initialize_rejects_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_minutes must be > 0, got 0"):
        initialize_parallel(timeout_minutes=0)


@pytest.mark.parametrize("backend,cuda,device_id", [
    ("nccl", True, torch.device("cuda", 3)), ("cpu:gloo,cuda:nccl", True, torch.device("cuda", 3)),
    ("gloo", True, None), ("gloo", False, None), ("nccl", False, None),
])
def test_default_group_is_bound_to_the_local_gpu_under_nccl(monkeypatch, backend, cuda, device_id) -> None:
    """nccl with CUDA passes ``device_id=cuda:LOCAL_RANK`` (and sets that device); gloo and CPU runs pass nothing."""
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                        "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    calls, devices = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    process_groups.init_default_group(backend, timedelta(minutes=2))
    expected = {"timeout": timedelta(minutes=2)} | ({"device_id": device_id} if device_id else {})
    assert calls == [((backend,), expected)]
    assert devices == ([device_id] if device_id else [])


def test_initialize_without_launcher_says_how_to_launch(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        initialize_parallel(backend="gloo")
    assert not ps.parallel_is_initialized()


def test_initialize_from_torchrun_env_owns_and_destroys_default_group(monkeypatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"world size 1 != tp\*cp\*dp = 1\*1\*2 = 2"):
        initialize_parallel(dp=2, backend="gloo")
    assert not dist.is_initialized(), "a size error must be raised before the default group is created"
    made = []  # every options object handed to DeviceMesh: c10d writes each group's ranks into its own
    original = process_groups._subgroup_override
    monkeypatch.setattr(process_groups, "_subgroup_override",
                        lambda *args, **kwargs: made.append(original(*args, **kwargs)) or made[-1])
    try:
        state = initialize_parallel(backend="gloo", timeout_minutes=3)
        assert len(made) == 5 and len({id(options) for _, options in made}) == 5, "options objects are shared"
        assert state.owns_default_group and state.dims == ps.ParallelDims() and state.backend == "gloo"
        for axis in (state.tp, state.cp, state.dp, state.dp_cp, state.tp_cp):
            timeout = axis.group._get_backend(torch.device("cpu")).options._timeout
            assert timeout == timedelta(minutes=3), f"group {axis.ranks} has timeout {timeout}"
        assert state.mesh.mesh_dim_names == ("dp", "cp", "tp")
        assert (state.cp_prev_rank, state.cp_next_rank) == (0, 0)
    finally:
        ps.destroy_parallel()
    assert not dist.is_initialized(), "destroy_parallel must destroy the default group it created"
