"""A key set to a value the run cannot use gets one note naming what it needs (``config.sources.unused_settings``):
FSDP's options without FSDP, FP8's bf16 blocks without FP8, the CP check's tolerance without the check, the
profile's steps without the profile, a checkpoint's options without a save directory, sequence parallelism at tp 1.
Only keys a config file or the command line set count; the shipped configs get none."""

from __future__ import annotations

from pathlib import Path

import pytest

from cp_train.config.sources import build_config, load_config, unused_settings
from tests import trainer_cases
from tests.entry_points import run, write_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "launch" / "configs").glob("*.yaml"))


def _notes(**values: object) -> tuple[str, ...]:
    return unused_settings(build_config([("test", values)]))


@pytest.mark.parametrize("values,key,need", [
    ({"parallel.fsdp_reduce": "per_microbatch"}, "parallel.fsdp_reduce", "parallel.fsdp=true (--fsdp)"),
    ({"parallel.fsdp_reshard_after_forward": False}, "parallel.fsdp_reshard_after_forward", "parallel.fsdp=true"),
    ({"model.fp8_bf16_layers_at_start": 1}, "model.fp8_bf16_layers_at_start", "model.fp8 tensorwise or rowwise"),
    ({"model.fp8_bf16_layers_at_end": 1}, "model.fp8_bf16_layers_at_end", "model.fp8 tensorwise or rowwise"),
    ({"train.check_cp_tolerance": 1e-3}, "train.check_cp_tolerance", "train.check_cp_every > 0"),
    ({"logging.profile_step_start": 3}, "logging.profile_step_start", "logging.profile=true (--profile)"),
    ({"logging.profile_ranks": [1]}, "logging.profile_ranks", "logging.profile=true (--profile)"),
    ({"checkpoint.keep": 5}, "checkpoint.keep", "checkpoint.save (--save DIR)"),
    ({"checkpoint.async_save": True}, "checkpoint.async_save", "checkpoint.save (--save DIR)"),
    ({"parallel.sequence_parallel": True}, "parallel.sequence_parallel", "parallel.tp > 1"),
])
def test_a_value_the_run_cannot_use_gets_one_note(values: dict, key: str, need: str) -> None:
    notes = _notes(**values)
    assert len(notes) == 1 and notes[0].startswith(f"{key} is set but does nothing in this run: it needs {need}")


@pytest.mark.parametrize("values", [
    {"parallel.fsdp": True, "parallel.fsdp_reduce": "per_microbatch", "parallel.fsdp_reshard_after_forward": False},
    {"model.fp8": "tensorwise", "model.fp8_bf16_layers_at_start": 1},
    {"train.check_cp_every": 10, "train.check_cp_tolerance": 1e-3},
    {"logging.profile": True, "logging.profile_step_start": 3, "logging.profile_ranks": [0]},
    {"checkpoint.save": "ckpt", "checkpoint.keep": 5, "checkpoint.async_save": True},
    {"checkpoint.async_save": False, "parallel.sequence_parallel": False},  # off: nothing was asked for
    {"parallel.tp": 2, "parallel.sequence_parallel": True},
    {},
])
def test_values_the_run_uses_get_none(values: dict) -> None:
    assert _notes(**values) == ()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_the_shipped_configs_get_none(path: Path) -> None:
    assert unused_settings(load_config(path)) == ()


def test_the_note_is_among_the_runs_first_lines(tmp_path: Path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    config = write_config(tmp_path / "run.yaml", corpus, tmp_path / "run",
                          **{"train.steps": 2, "schedule.warmup_steps": 1})
    done = run(["--config", str(config), "--set", "parallel.fsdp_reshard_after_forward=false"])
    assert done.returncode == 0, done.output[-3000:]
    assert ("[cp-train] parallel.fsdp_reshard_after_forward is set but does nothing in this run: it needs "
            "parallel.fsdp=true (--fsdp)") in done.output.splitlines(), done.output[-3000:]
