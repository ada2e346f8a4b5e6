"""A training step's scalars kept on the device until a log step reads them all at once.

On a GPU every read of a device tensor to the host (``float``, ``item``, ``tolist``, ``bool``) waits for the
device to finish all the work queued before it: the CPU stops launching kernels and the GPU then idles
until the next ones arrive. So a step leaves its loss, gradient norm, global loss-token count and attention
pairs on the device (``DeviceBatch``, ``DeviceStep``), and ``UnreadSteps.read`` moves the steps gathered
since the last read to the host in one read: at log steps, and where something needs them (evaluation,
checkpoints, the end of a run). ``divergence`` names what is not finite in a step once it has been read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cp_train.results import StepResult


@dataclass(frozen=True)
class DeviceBatch:
    """What ``Trainer.forward_backward`` measured on one global batch (read by name, never unpacked); the
    tensors are fp64 scalars on the device, not read to the host."""

    loss: torch.Tensor  # global mean over the loss tokens of the global batch
    tokens: torch.Tensor  # loss tokens of the global batch
    local_tokens: float  # loss tokens of this rank's micro-batches (counted from the CPU masks)
    local_loss_sum: torch.Tensor  # this rank's summed token losses
    imbalance: float  # attention work of the busiest CP rank over the mean (1.0: balanced)
    attention_pairs: int = 0  # visible query-key pairs of this replica's micro-batches (per-document masks)
    first_loss_sum: torch.Tensor | None = None  # this rank's summed token losses of the first micro-batch


@dataclass(frozen=True)
class DeviceStep:
    """One optimizer step's scalars: host numbers, and ``values`` (fp64 ``[4]`` on the device): the loss, the
    gradient norm (before clipping), the global loss tokens and the attention pairs (NaN: not counted)."""

    step: int  # 1-based
    lr: float
    local_tokens: float
    imbalance: float
    values: torch.Tensor

    @classmethod
    def of(cls, step: int, lr: float, batch: DeviceBatch, grad_norm: torch.Tensor,
           pairs: torch.Tensor | None) -> DeviceStep:
        """Step ``step``'s scalars: ``batch``, its global ``grad_norm`` and its summed ``pairs`` (None: not
        counted), stacked on the device without a read."""
        nan = torch.full_like(batch.loss, math.nan)
        parts = [batch.loss, grad_norm, batch.tokens, nan if pairs is None else pairs]
        values = torch.stack([part.detach().double().reshape(()) for part in parts])
        return cls(step, lr, batch.local_tokens, batch.imbalance, values)


class UnreadSteps:
    """The steps whose scalars are still on the device, in step order."""

    def __init__(self) -> None:
        self._steps: list[DeviceStep] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: DeviceStep) -> None:
        self._steps.append(step)

    def read(self) -> list[tuple[int, StepResult]]:
        """Every unread step as ``(step, StepResult)`` in order, read to the host in one read (none: no read);
        they are then no longer unread."""
        if not self._steps:
            return []
        steps, self._steps = self._steps, []
        rows = torch.stack([s.values for s in steps]).tolist()
        return [(s.step, StepResult(loss=loss, grad_norm=norm, lr=s.lr, loss_tokens=tokens,
                                    local_loss_tokens=s.local_tokens, imbalance=s.imbalance,
                                    attention_pairs=None if math.isnan(pairs) else pairs))
                for s, (loss, norm, tokens, pairs) in zip(steps, rows, strict=True)]


def divergence(step: int, out: StepResult, updated: int, interval: int) -> str | None:
    """What stops the run when step ``step``'s loss or gradient norm (``out``) is not finite (the loss first),
    else None. ``updated``: the last step whose update ran (``step - 1``: read before its own update);
    ``interval``: ``logging.interval``, the most steps between reads."""
    if math.isfinite(out.loss) and math.isfinite(out.grad_norm):
        return None
    if not math.isfinite(out.loss):
        what = f"loss is {out.loss} at step {step}"
    else:
        what = f"gradient norm is {out.grad_norm} at step {step} (loss {out.loss:.4f})"
    done = "before the update"
    if step <= updated:
        ran = f"the update of step {step}" if step == updated else f"the updates of steps {step} to {updated}"
        done = (f"after {ran}, which no checkpoint holds (the check runs at log, evaluation and checkpoint "
                f"steps; logging.interval {interval})")
    return f"{what}: stopping the run {done}"
