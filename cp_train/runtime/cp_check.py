"""``train.check_cp_every``: the run checks its own CP result.

At every N-th step, before the step runs, each rank computes the loss of the step's first micro-batch again
without CP: the whole sample, read from the dataset on this rank (no communication), through the model with its
CP group set aside (``GPTModel.without_context_parallel``: the attention on this rank alone; TP, FSDP's gathers
and the weights as they are), forward only, no gradient, eager. After the step the CP loss of that micro-batch
(each CP rank's share summed over the CP group) is compared with it; the relative error, agreed over every rank
(its maximum), goes into the step's metrics record as ``cp_check_rel_err``. Beyond ``train.check_cp_tolerance``
(default by dtype: 1e-5 fp32, 2e-2 bf16/fp16) every rank stops with one line (``RunFailure``).

The step itself is untouched (its losses are bitwise those of a run without the check): the reference runs before
the step on the same weights, reads no RNG, keeps no graph, and its compiled parts run eagerly. Every rank runs it
(the same collectives on every rank: TP's, FSDP's), each on its whole sample. Cost: one forward of the whole
sample per rank, about a third of a step of cp ranks' work (the planner's estimate at 8B/128k: docs/training.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from cp_train.config.schema import Config
from cp_train.data.loader import StepLoader
from cp_train.errors import RunFailure
from cp_train.loss import masked_loss_sum
from cp_train.metrics.throughput import max_over_ranks
from cp_train.parallel.mesh.state import ParallelState

DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
HINT = ("the CP attention or its communication is wrong on this setup: rerun the step with "
        "--set parallel.cp_algorithm=allgather or --set model.attention_kernel=math to locate it, or report this line")


def tolerance(configured: float | None, dtype: torch.dtype | None) -> float:
    """``train.check_cp_tolerance``, else the default of the compute dtype (autocast's; None: fp32)."""
    return configured if configured is not None else DEFAULT_TOLERANCE.get(dtype or torch.float32, 2e-2)


class CPCheck:
    """The check of one run: its ``config``, groups (``state``), ``model`` (a ``GPTModel``, FSDP's or not), train
    ``loader``, ``device`` and ``autocast`` (the step's autocast context); off (``every`` 0) without CP."""

    def __init__(self, config: Config, state: ParallelState, model: Any, loader: StepLoader, device: torch.device,
                 autocast_dtype: torch.dtype | None, autocast: Callable[[], contextlib.AbstractContextManager]
                 ) -> None:
        self.config, self.state, self.model, self.loader, self.device = config, state, model, loader, device
        self.autocast = autocast
        self.every = config.train.check_cp_every if state.cp.size > 1 else 0
        self.tolerance = tolerance(config.train.check_cp_tolerance, autocast_dtype)
        self.reference: torch.Tensor | None = None  # the loss sum without CP of the step being checked
        self.tokens = 1.0  # its loss tokens

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is checked (it is then also a log step)."""
        return bool(self.every) and step % self.every == 0

    def whole_sample(self) -> dict[str, Any]:
        """The first micro-batch of the step the loader handed out last, whole (``[B, seq_len]`` per token), on the
        device: read from the dataset by the sampler's indices, as the loader read it before its CP slicing."""
        loader = self.loader
        start = loader.consumed_samples - loader.sampler.global_batch_size
        indices = loader.sampler.step_micro_batches(start)[0]
        dataset = loader.loader.dataset
        batch = default_collate([dataset[i] for i in indices])
        return {key: value.to(self.device) for key, value in batch.items() if isinstance(value, torch.Tensor)}

    @torch.no_grad()
    def before_step(self) -> None:
        """The loss sum of the coming step's first micro-batch without CP (collective over TP and FSDP's groups)."""
        mb = self.whole_sample()
        documents = mb.get("document_ids") if self.config.data.document_mask else None
        with self.model.without_context_parallel(), torch.compiler.set_stance("force_eager"), self.autocast():
            losses = self.model(mb["tokens"], mb["position_ids"], labels=mb["labels"], document_ids=documents)
        self.reference = masked_loss_sum(losses, mb["loss_mask"]).double()
        self.tokens = max(float(mb["loss_mask"].sum()), 1.0)

    def after_step(self, step: int, cp_first_sum: torch.Tensor) -> float:
        """The relative error of the step's CP loss of its first micro-batch (``cp_first_sum``: this rank's share)
        against the reference, the maximum over every rank; ``RunFailure`` on every rank beyond the tolerance."""
        state, reference = self.state, self.reference
        self.reference = None
        total = cp_first_sum.detach().double().reshape(1).clone()
        dist.all_reduce(total, group=state.cp.group)
        cp_loss, ref_loss = total.item(), reference.item()
        local = abs(cp_loss - ref_loss) / max(abs(ref_loss), 1e-30)
        error, = max_over_ranks([local if math.isfinite(local) else float("inf")], state.host_group)
        if error > self.tolerance:
            parallel = self.config.parallel
            layout = (f"tp{state.tp.size} cp{state.cp.size} dp{state.dp.size} {parallel.cp_algorithm} "
                      f"{parallel.cp_layout}")
            raise RunFailure(f"CP check at step {step}: the first micro-batch's loss with CP differs from the loss "
                             f"without CP by {error:.3g} relative (> train.check_cp_tolerance {self.tolerance:g}; "
                             f"per token {cp_loss / self.tokens:.6g} with CP, {ref_loss / self.tokens:.6g} "
                             f"without) at {layout}: {HINT}")
        return error
