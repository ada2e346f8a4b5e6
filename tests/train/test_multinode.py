"""Several nodes without a cluster: two launchers on this machine meeting at a c10d rendezvous (two "nodes" of 2
ranks), and the Slurm script run with stand-ins for ``srun`` and ``scontrol`` up to the command it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cp_train.checkpoint.dcp import step_dir_name
from cp_train.parallel.spawn import free_port
from tests import trainer_cases
from tests.entry_points import REPO, TRAIN, environment, write_config

NODES, PER_NODE, STEPS, SAVE_AT = 2, 2, 6, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def _two_nodes(config: Path, run_id: str, timeout: float = 300) -> list[str]:
    """Both "nodes" (``cp_train.cli.launch`` with torchrun's multi-node flags) at once; their outputs."""
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "cp_train.cli.launch", "--nnodes", str(NODES), "--nproc-per-node",
               str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, TRAIN,
               "--config", str(config)]
    nodes = [subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(NODES)]
    outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    return outputs


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_train_hsdp_across_them_and_resume_bitwise(corpus, tmp_path) -> None:
    """cp 2 inside each node, HSDP's 2 replicas across the nodes: FSDP gathers inside a node (its shard group
    is a node's two ranks), the replicas' all-reduce crosses; a resume from the step-3 checkpoint in a new pair of
    launchers gives the uninterrupted run's losses bitwise."""
    hsdp = {"parallel.fsdp": True, "parallel.dp_replicate": 2, "train.steps": STEPS, "train.global_batch_size": 4}
    whole = write_config(tmp_path / "whole.yaml", corpus, tmp_path / "whole", cp=2, **hsdp,
                         **{"checkpoint.save": str(tmp_path / "ckpt"), "checkpoint.interval": SAVE_AT})
    _two_nodes(whole, "whole")
    records = _records(tmp_path / "whole")
    setup = next(r for r in records if r["kind"] == "setup")
    assert setup["nodes"]["ranks_per_node"] == PER_NODE and setup["nodes"]["dp_replicate"] == 2
    assert setup["nodes"]["fsdp_shard_ranks"] == [0, 1]  # rank 0's FSDP group: its own node's two ranks
    assert "dp_replicate" in setup["nodes"]["crossing"] and "dp_shard_cp" not in setup["nodes"]["crossing"]
    assert "cp" not in setup["nodes"]["crossing"]
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert sorted(losses) == list(range(1, STEPS + 1))

    resumed = write_config(tmp_path / "resumed.yaml", corpus, tmp_path / "resumed", cp=2, **hsdp,
                           **{"checkpoint.load": str(tmp_path / "ckpt" / step_dir_name(SAVE_AT))})
    _two_nodes(resumed, "resumed")
    again = {r["step"]: r["loss"] for r in _records(tmp_path / "resumed") if r["kind"] == "train"}
    assert again == {step: losses[step] for step in range(SAVE_AT + 1, STEPS + 1)}


def test_the_slurm_script_starts_torchrun_on_every_node(tmp_path) -> None:
    """``launch/slurm.sbatch`` with stand-ins for srun and scontrol: every node runs the launcher with torchrun's
    multi-node flags, meeting at the first node's rendezvous."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun.args\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1\" = show ] && printf 'gpu-a\\ngpu-b\\n'\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8"}
    done = subprocess.run(["bash", "launch/slurm.sbatch", "launch/configs/gpt-1b-128k-cp8.yaml", "--save", "ckpt"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().split()
    assert args[:4] == ["--kill-on-bad-exit=1", "python", "-m", "cp_train.cli.launch"]
    assert args[4:14] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          "gpu-a:29500", "--rdzv-id", "4242"]
    assert args[14:] == [f"{REPO}/train.py", "--config", "launch/configs/gpt-1b-128k-cp8.yaml", "--save", "ckpt"]
