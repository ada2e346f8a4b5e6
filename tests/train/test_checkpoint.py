"""Checkpoints: exact resume in fresh processes, resume into other layouts and across FSDP on/off, and
interrupted saves.

A (1, 2, 1) run saves at step 4 of 8, once with DDP and once with FSDP. Resuming either in the same
setting must reproduce the uninterrupted run's losses bitwise (the DDP one in fresh processes); resuming
with cp 2 -> 4, dp 1 -> 2, tp 1 -> 2, or with FSDP switched on or off, must load the very same parameters
and Adam moments (resharded by DCP), continue the data stream at the same global sample and match the
uninterrupted losses within 1e-5; a save that dies part way must leave ``latest`` on the previous
complete checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from cp_train.checkpoint.dcp import LATEST, META, find_checkpoint, step_dir_name
from cp_train.checkpoint.export_hf import export_checkpoint
from cp_train.checkpoint.rng import capture_rng_state, restore_rng_state
from cp_train.parallel.mesh.state import ParallelDims, run_with_parallel
from cp_train.parallel.spawn import RankError, SpawnedWorld
from tests import checkpoint_cases, trainer_cases

STEPS, SAVE_AT, LAYOUT = 8, 4, (1, 2, 1)
# change -> (target layout, fsdp of the saved run, fsdp of the resumed run)
CHANGED_LAYOUTS = {"cp 2->4": ((1, 4, 1), False, False), "dp 1->2": ((1, 2, 2), False, False),
                   "tp 1->2": ((2, 2, 1), False, False), "fsdp tp 1->2": ((2, 2, 1), True, True),
                   "fsdp dp 1->2": ((1, 2, 2), True, True)}
WANT = ("params", "optimizer")
FSDP = {"parallel.fsdp": True}


def run(world, layout, corpus: str, run_dir: Path, until_step: int | None = None, want=(), fsdp=False, **overrides):
    overrides = {"train.steps": STEPS, "parallel.fsdp": fsdp, **overrides}
    return world.run(run_with_parallel, layout, trainer_cases.train_layout, corpus, str(run_dir), overrides,
                     until_step, want)


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: different keys"
    differing = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differing, f"{what}: not bitwise equal: {differing}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


def _saved(world, corpus: str, root: Path, fsdp: bool) -> dict:
    """The uninterrupted run's losses, and a checkpoint at step 4 of the same run with its full states."""
    uninterrupted = run(world, LAYOUT, corpus, root / "uninterrupted", fsdp=fsdp)[0]["losses"]
    first_half = run(world, LAYOUT, corpus, root / "first-half", SAVE_AT, WANT, fsdp=fsdp,
                     **{"checkpoint.save": str(root / "checkpoints")})[0]
    return {"losses": uninterrupted, "first_half": first_half, "checkpoints": root / "checkpoints", "root": root}


@pytest.fixture(scope="module")
def saved(spawn_world, corpus, tmp_path_factory) -> dict:
    return _saved(spawn_world(2), corpus, tmp_path_factory.mktemp("ckpt"), fsdp=False)


@pytest.fixture(scope="module")
def saved_fsdp(spawn_world, corpus, tmp_path_factory) -> dict:
    return _saved(spawn_world(2), corpus, tmp_path_factory.mktemp("ckpt-fsdp"), fsdp=True)


def assert_resumed(answer: dict, source: dict, what: str, exact: bool) -> None:
    """``answer`` (a run resumed from ``source``'s checkpoint) loaded its states bitwise and continued its
    stream: the uninterrupted losses bitwise (``exact``) or within 1e-5."""
    assert answer["step_at_start"] == SAVE_AT, what
    assert answer["consumed_at_start"] == SAVE_AT * trainer_cases.GLOBAL_BATCH, what
    for kind in WANT:  # resharded by DCP, every value lands where it belongs
        assert_same_tensors(answer["start"][kind], source["first_half"]["end"][kind], f"{what}: loaded {kind}")
    expected = {step: source["losses"][step] for step in range(SAVE_AT + 1, STEPS + 1)}
    if exact:
        assert answer["losses"] == expected, f"{what}: resumed losses are not bitwise the uninterrupted run's"
    for step, loss in expected.items():
        assert abs(answer["losses"][step] - loss) <= 1e-5 * abs(loss), (what, step)


def test_checkpoint_files_and_latest_pointer(saved) -> None:
    checkpoints = saved["checkpoints"]
    assert (checkpoints / LATEST).read_text().strip() == step_dir_name(SAVE_AT)
    found = find_checkpoint(checkpoints)
    assert found == checkpoints / step_dir_name(SAVE_AT)
    meta = json.loads((found / META).read_text())
    assert meta["step"] == SAVE_AT and meta["consumed_samples"] == SAVE_AT * trainer_cases.GLOBAL_BATCH
    assert meta["layout"] == {"tp": 1, "cp": 2, "dp": 1, "world_size": 2, "cp_layout": "zigzag",
                              "cp_algorithm": "ring", "fsdp": False}
    assert meta["config"]["train"]["steps"] == STEPS and meta["scheduler"]["step"] == SAVE_AT
    assert (found / ".metadata").is_file() and sorted(p.name for p in (found / "rng").iterdir()) == [
        "rank_00000.pt", "rank_00001.pt"]
    assert saved["first_half"]["losses"] == {s: saved["losses"][s] for s in range(1, SAVE_AT + 1)}


def test_exact_resume_in_fresh_processes(saved, corpus, tmp_path) -> None:
    with SpawnedWorld(2) as fresh:
        resumed = run(fresh, LAYOUT, corpus, tmp_path, want=WANT, **{"checkpoint.load": str(saved["checkpoints"])})
    assert_resumed(resumed[0], saved, "DDP", exact=True)
    assert not any("layout changed" in m for m in resumed[0]["messages"])


def test_exact_resume_with_fsdp(spawn_world, saved_fsdp, corpus, tmp_path) -> None:
    meta = json.loads((find_checkpoint(saved_fsdp["checkpoints"]) / META).read_text())
    assert meta["layout"]["fsdp"] is True
    answer = run(spawn_world(2), LAYOUT, corpus, tmp_path, want=WANT, fsdp=True,
                 **{"checkpoint.load": str(saved_fsdp["checkpoints"])})[0]
    assert_resumed(answer, saved_fsdp, "FSDP", exact=True)


@pytest.mark.parametrize("switch", ["fsdp on->off", "fsdp off->on"])
def test_resume_switching_fsdp(spawn_world, saved, saved_fsdp, corpus, tmp_path, switch) -> None:
    source, fsdp = (saved_fsdp, False) if switch == "fsdp on->off" else (saved, True)
    answer = run(spawn_world(2), LAYOUT, corpus, tmp_path, want=WANT, fsdp=fsdp,
                 **{"checkpoint.load": str(source["checkpoints"])})[0]
    assert_resumed(answer, source, switch, exact=False)
    assert any(f"parallel.fsdp {not fsdp} -> {fsdp}" in m for m in answer["messages"]), answer["messages"]


@pytest.mark.parametrize("change", list(CHANGED_LAYOUTS))
def test_resume_with_another_layout(spawn_world, saved, saved_fsdp, corpus, tmp_path, change) -> None:
    layout, saved_with_fsdp, fsdp = CHANGED_LAYOUTS[change]
    source = saved_fsdp if saved_with_fsdp else saved
    save_again = {"checkpoint.save": str(tmp_path / "again")} if fsdp and layout[0] > 1 else {}
    answer = run(spawn_world(4), layout, corpus, tmp_path, want=WANT, fsdp=fsdp,
                 **{"checkpoint.load": str(source["checkpoints"]), **save_again})[0]
    assert_resumed(answer, source, change, exact=False)
    notes = [m for m in answer["messages"] if "layout changed" in m]
    assert notes and "RNG re-derived from train.seed" in notes[0], answer["messages"]
    assert f"to {ParallelDims(tp=layout[0], cp=layout[1], dp=layout[2])}" in notes[0], notes
    if save_again:  # a checkpoint saved with TP and FSDP splitting different dims reads back into (1, 2, 1)
        back = run(spawn_world(2), LAYOUT, corpus, tmp_path / "back", want=WANT, **save_again)[0]
        assert back["step_at_start"] == STEPS and not back["losses"]
        for kind in WANT:
            assert_same_tensors(back["start"][kind], answer["end"][kind], f"{change} and back: {kind}")


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_interrupted_save_keeps_latest_on_previous_checkpoint(spawn_world, saved, saved_fsdp, corpus, tmp_path,
                                                              fsdp) -> None:
    source = saved_fsdp if fsdp else saved
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(source["checkpoints"], checkpoints)  # resume from step 4, save at 6, die saving 8
    overrides = {"train.steps": STEPS, "checkpoint.save": str(checkpoints), "checkpoint.interval": 2,
                 "parallel.fsdp": fsdp}
    world = spawn_world(2)
    errors = world.run(run_with_parallel, LAYOUT, trainer_cases.train_with_failing_save, corpus, str(tmp_path),
                       overrides, STEPS, 1)
    assert all("simulated crash of rank 1" in error for error in errors), errors
    assert (checkpoints / LATEST).read_text().strip() == step_dir_name(6)
    partial = checkpoints / step_dir_name(STEPS)
    assert partial.is_dir() and not (partial / META).exists() and any(partial.glob("*.distcp"))
    assert find_checkpoint(checkpoints) == checkpoints / step_dir_name(6)
    resumed = run(world, LAYOUT, corpus, tmp_path / "after-crash", fsdp=fsdp,
                  **{"checkpoint.save": str(checkpoints)})[0]
    assert resumed["step_at_start"] == 6
    assert resumed["losses"] == {step: source["losses"][step] for step in (7, 8)}
    assert (checkpoints / LATEST).read_text().strip() == step_dir_name(STEPS)  # the retried save completed


def test_training_longer_continues_the_same_sample_stream(spawn_world, corpus, tmp_path) -> None:
    """A run of N steps resumed with train.steps = 2N sees the batches an uninterrupted 2N-step run sees."""
    world, half = spawn_world(2), STEPS // 2
    short = run(world, LAYOUT, corpus, tmp_path / "short", **{"train.steps": half,
                                                                "checkpoint.save": str(tmp_path / "ck")})
    longer = run(world, LAYOUT, corpus, tmp_path / "longer", **{"checkpoint.load": str(tmp_path / "ck")})
    whole = run(world, LAYOUT, corpus, tmp_path / "whole")
    for rank in range(2):
        assert short[rank]["batches"] == {s: whole[rank]["batches"][s] for s in range(1, half + 1)}
        assert longer[rank]["batches"] == {s: whole[rank]["batches"][s] for s in range(half + 1, STEPS + 1)}
    assert longer[0]["step_at_start"] == half
    assert any(f"train.steps {half} -> {STEPS}" in m for m in longer[0]["messages"]), longer[0]["messages"]
    with pytest.raises(RankError, match=rf"is at step {half}, beyond train.steps 1: raise --train-steps"):
        run(world, LAYOUT, corpus, tmp_path / "shorter", **{"train.steps": 1, "checkpoint.load": str(tmp_path / "ck")})


def test_rng_state_resumes_every_stream_and_only_this_ranks_cuda_generator(monkeypatch) -> None:
    """Python, numpy and torch continue exactly; of CUDA's generators only this rank's device is saved, so a
    resume on a node showing fewer GPUs per process does not index a generator it lacks."""
    state = capture_rng_state()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])

    def refuse(*args, **kwargs):
        raise AssertionError("every device's CUDA generator touched")

    device_state, restored = torch.arange(4, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": device_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda new_state, device="cuda": restored.append(new_state))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", refuse)
    state = capture_rng_state()
    assert state["cuda"] is device_state
    restore_rng_state(state)
    assert restored == [device_state]


def test_a_checkpoint_with_gate_and_up_apart_resumes_and_exports_the_same(spawn_world, saved_fsdp, corpus,
                                                                           tmp_path) -> None:
    """A checkpoint saved while gate and up were two weights (``cp_train/checkpoint/legacy.py``) loads into the
    fused weight's blocks: the same parameters and Adam moments, the uninterrupted losses bitwise; evaluation loads
    the same weights from it, and its HF export equals the fused checkpoint's."""
    fused = find_checkpoint(saved_fsdp["checkpoints"])
    ffn = json.loads((fused / META).read_text())["config"]["model"]["ffn_hidden_size"]
    apart = checkpoint_cases.with_gate_and_up_apart(fused, tmp_path / "apart", ffn)
    assert "model.layers.0.mlp.gate.weight" in FileSystemReader(apart).read_metadata().state_dict_metadata
    answer = run(spawn_world(2), LAYOUT, corpus, tmp_path / "run", want=WANT, fsdp=True,
                 **{"checkpoint.load": str(tmp_path / "apart")})[0]
    assert_resumed(answer, saved_fsdp, "gate and up apart", exact=True)
    evaluated = [spawn_world(2).run(run_with_parallel, LAYOUT, checkpoint_cases.evaluated_weights, str(path))[0]
                 for path in (fused, apart)]
    assert_same_tensors(evaluated[1], evaluated[0], "evaluation's weights")
    exports = [export_checkpoint(path, tmp_path / f"hf-{index}") for index, path in enumerate((fused, apart))]
    tensors = [load_file(path / "model.safetensors") for path in exports]
    assert "model.layers.0.mlp.up_proj.weight" in tensors[0]
    assert_same_tensors(tensors[1], tensors[0], "HF export")


def test_exit_interval_and_time_limit_save_stop_and_the_same_call_resumes(spawn_world, saved, corpus,
                                                                          tmp_path) -> None:
    """Megatron-LM's ``--exit-interval 3`` (``train.exit_interval``): the first call saves after step 3 and stops
    with one line, the same call again after step 6, the third ends the run at step 8; together the uninterrupted
    run's losses, bitwise. ``--exit-duration-in-mins`` (``train.exit_duration_minutes``) already past when step 1
    ends: the run stops after step 1 with the time limit's line."""
    calls = [run(spawn_world(2), LAYOUT, corpus, tmp_path / "run", **{"train.exit_interval": 3,
                                                                      "checkpoint.save": str(tmp_path / "ckpt")})[0]
             for _ in range(3)]
    assert [call["step_at_start"] for call in calls] == [0, 3, 6]
    assert [[m for m in call["messages"] if "stopped at step" in m] for call in calls] == [
        [f"train.exit_interval 3 reached: stopped at step {step} after saving a checkpoint; rerun the same command to "
         f"resume"] for step in (3, 6)] + [[]]
    assert {step: loss for call in calls for step, loss in call["losses"].items()} == saved["losses"]
    timed = run(spawn_world(2), LAYOUT, corpus, tmp_path / "timed", **{"train.exit_duration_minutes": 1e-5,
                                                                        "checkpoint.save": str(tmp_path / "timed")})[0]
    assert sorted(timed["losses"]) == [1] and timed["messages"][-1] == (
        "the time limit (train.exit_duration_minutes 1e-05) reached: stopped at step 1 after saving a checkpoint; "
        "rerun the same command to resume")
