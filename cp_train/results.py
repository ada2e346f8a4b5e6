"""What a training step and a run return, and the error that stops a diverging run."""

from __future__ import annotations

from dataclasses import dataclass, field

from cp_train.errors import RunFailure


class NonFiniteLossError(RunFailure, FloatingPointError):
    """The loss (or the gradient norm) became NaN or Inf; the message names the step and the checkpoint to
    resume from."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    loss_tokens: float  # of the global batch
    local_loss_tokens: float  # of this rank
    imbalance: float = 1.0  # attention work, busiest CP rank / mean
    attention_pairs: float | None = None  # of the global batch, with per-document masks (else causal: S^2 / 2)


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> global loss
    grad_norms: dict[int, float] = field(default_factory=dict)  # before clipping
    eval_losses: dict[int, float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    run_dir: str = ""
    final_step: int = 0
