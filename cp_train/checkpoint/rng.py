"""Runtime RNG states (python, numpy, torch CPU and CUDA): seeding, capture and restore, per rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def derived_seed(seed: int, rank: int, step: int = 0) -> int:
    """A seed for ``rank`` at ``step`` derived from the run's ``seed`` (stable across processes)."""
    return (seed * 1_000_003 + rank * 7919 + step * 104_729) % (2**31 - 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CUDA generators too


def capture_rng_state() -> dict[str, Any]:
    """Everything needed to continue this process's random streams exactly."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this rank's device only: a resume may see fewer GPUs per process than the save did
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
