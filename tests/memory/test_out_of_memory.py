"""A device out of memory, in a step, in the validation after one or while the model is built, is one line on the
rank that ran out: torch's first words, where, the peak, and the dry run's plan of the run's config with what to
change."""

from __future__ import annotations

import re

import torch

from cp_train import run_parts
from cp_train.memory.out_of_memory import OutOfDeviceMemory
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel
from cp_train.trainer import Trainer
from tests import trainer_cases

TORCH_SAYS = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
              "1.02 GiB is free. Including non-PyTorch memory, this process has 78.15 GiB memory in use.")


def run_out_of_memory_in_step_2(state: ParallelState, corpus: str, run_dir: str,
                                 in_validation: bool = False) -> tuple[str, bool, int]:
    """Rank side: the tiny run whose second step's forward raises torch's out-of-memory error, or
    (``in_validation``) the forward of the validation after step 2."""
    trainer = Trainer(trainer_cases.tiny_config(corpus, run_dir, state.dims, **{
        "train.steps": 3, "train.valid_interval": 2 if in_validation else 0}), state)
    losses = trainer._losses

    def failing(mb: dict) -> object:
        if trainer.step == (2 if in_validation else 1) and trainer.module.training != in_validation:
            raise torch.OutOfMemoryError(TORCH_SAYS)
        return losses(mb)

    trainer._losses = failing  # type: ignore[method-assign]
    try:
        trainer.train()
    except OutOfDeviceMemory as error:
        return str(error), error.everywhere, error.exit_code
    raise AssertionError("the run did not fail")


def run_out_of_memory_building_the_model(state: ParallelState, corpus: str, run_dir: str) -> str:
    """Rank side: the tiny run whose model's build raises torch's out-of-memory error."""
    build = run_parts.build_training_state

    def failing(env: object) -> object:
        raise torch.OutOfMemoryError(TORCH_SAYS)

    run_parts.build_training_state = failing
    try:
        Trainer(trainer_cases.tiny_config(corpus, run_dir, state.dims), state)
    except OutOfDeviceMemory as error:
        return str(error)
    finally:
        run_parts.build_training_state = build
    raise AssertionError("the build did not fail")


def test_out_of_memory_says_the_plan_and_what_to_change(spawn_world, tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    world = spawn_world(1)
    building = world.run(run_with_parallel, (1, 1, 1), run_out_of_memory_building_the_model, corpus,
                         str(tmp_path / "build"))[0]
    assert building.startswith("the cpu device ran out of memory on rank 0 building the model (CUDA out of memory. "
                               "Tried to allocate 2.00 GiB; peak "), building
    assert "; to fit: --fsdp (shards parameters" in building
    line, everywhere, code = world.run(run_with_parallel, (1, 1, 1), run_out_of_memory_in_step_2, corpus,
                                       str(tmp_path / "run"))[0]
    assert line.startswith("the cpu device ran out of memory on rank 0 in step 2 (CUDA out of memory. Tried to "
                           "allocate 2.00 GiB; peak "), line
    assert re.search(r" GiB allocated\): the dry run plans [\d.]+ GiB for the largest rank of [\d.]+ GiB usable, "
                     r"within it: the dry run underestimates this run, or the reserve \(--reserve-gib\) is too "
                     r"small; to fit: --fsdp \(shards parameters, gradients and optimizer state over dp x cp\); .+ "
                     r"\(plan a change with python train.py ... --dry-run\)$", line), line
    assert "\n" not in line and not everywhere and code == 1  # said by the rank that ran out
    line = world.run(run_with_parallel, (1, 1, 1), run_out_of_memory_in_step_2, corpus, str(tmp_path / "valid"),
                     True)[0][0]
    assert line.startswith("the cpu device ran out of memory on rank 0 in the validation after step 2 (CUDA out of "
                           "memory. Tried to allocate 2.00 GiB; peak "), line
