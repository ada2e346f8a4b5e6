"""``logging.profile`` (Megatron-LM's ``--profile``): traces of the chosen steps on the chosen ranks, rank 0's
figures as one record; the settings' one-line errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from cp_train.config.schema import Config, ConfigError
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel
from cp_train.runtime.profiling import StepProfiler, check_profile_device
from cp_train.trainer import Trainer
from tests import trainer_cases


def profiled_run(state: ParallelState, corpus: str, run_dir: str) -> list[str]:
    """Rank side: 4 steps at cp 2, steps 2-3 profiled on both ranks; the names of the files written."""
    config = trainer_cases.tiny_config(corpus, run_dir, state.dims, **{
        "train.steps": 4, "train.valid_interval": 0, "logging.interval": 2, "logging.profile": True,
        "logging.profile_step_start": 2, "logging.profile_step_end": 4, "logging.profile_ranks": [0, 1]})
    result = Trainer(config, state).train()
    assert sorted(result.losses) == [1, 2, 3, 4]
    return sorted(path.name for path in (Path(run_dir) / "profile").iterdir())


def test_every_chosen_rank_writes_its_trace_and_rank_0_logs_the_figures(spawn_world, tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    files = spawn_world(2).run(run_with_parallel, (1, 2, 1), profiled_run, corpus, str(tmp_path / "run"))
    assert files[0] == files[1] == ["rank0-steps2-3.json.gz", "rank1-steps2-3.json.gz"]
    for rank in (0, 1):  # the ring's exchanges are in each rank's trace, under the run's step numbers
        events = json.load(gzip.open(tmp_path / "run" / "profile" / f"rank{rank}-steps2-3.json.gz"))["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
        assert {"c10d::send", "c10d::recv_", "c10d::allreduce_"} <= names  # the ring's messages, DDP's reduction
        copies = [e for e in events if e.get("name") == "aten::copy_" and e.get("cat") == "cpu_op"]
        assert copies and all("Input Dims" in e["args"] for e in copies)  # shapes recorded: which copy is which
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (profile,) = [r for r in records if r["kind"] == "profile"]
    assert profile["rank"] == 0 and profile["step"] == 3 and profile["profiled_steps"] == [2, 3]
    assert 0 <= profile["idle_fraction"] < 1 and profile["busy_s"] <= profile["step_s"]


def test_a_resume_past_the_steps_says_nothing_is_profiled(tmp_path) -> None:
    logging = Config().logging
    logging.profile = True
    assert StepProfiler(logging, 0, torch.device("cpu"), tmp_path, first_step=3).note() is None
    note = StepProfiler(logging, 0, torch.device("cpu"), tmp_path, first_step=10).note()
    assert note.startswith("logging.profile: steps 10-11 ran before the step this run resumed from; nothing is")
    logging.memory_snapshot = True
    with pytest.raises(ConfigError, match="^logging.memory_snapshot records CUDA's caching allocator, and this run "
                                          "is on cpu: set logging.memory_snapshot=false"):
        check_profile_device(Config(logging=logging), torch.device("cpu"))
