"""Data-parallel sampling by global sample count and the context-parallel split of each sample.

The global stream is samples ``0, 1, 2, ...`` of the dataset. A step takes the next
``global_batch_size`` samples from ``consumed_samples`` on; inside it, micro-batch ``m`` of DP
rank ``r`` holds samples ``step_start + m * mbs * dp + r * mbs + [0, mbs)``. Which samples a
step holds depends only on ``consumed_samples`` and ``global_batch_size``: every CP and TP rank
of one replica reads the same samples and keeps its own CP slice of every per-token tensor, and
a run resumed from ``consumed_samples`` continues the same stream whatever DP/CP sizes or CP
layout it resumes with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from cp_train.data.gpt_dataset import PER_TOKEN_KEYS
from cp_train.parallel.cp.balanced_layout import balanced_positions
from cp_train.parallel.cp.layout import check_layout, check_layout_name, sequence_positions, shard_sequence

CP_PLAN = "cp_plan"  # a micro-batch's key for its CP plan (built by the collate's planner)


def slice_for_context_parallel(batch: Mapping[str, Any], cp_rank: int, cp_size: int,
                               layout: str = "zigzag") -> dict[str, Any]:
    """This CP rank's part of a sample or micro-batch.

    Per-token tensors (``PER_TOKEN_KEYS``: ``[seq_len]`` or ``[B, seq_len]``) keep the positions
    ``parallel.layout.sequence_positions`` gives this rank, along their last dimension; anything
    else is passed through. With ``cp_size > 1``, ``seq_len`` must split evenly
    (``2*cp_size`` parts for zigzag, ``cp_size`` otherwise). The
    ``balanced`` layout picks each sample's positions from its ``document_ids`` (which it needs);
    ``position_ids`` then carry the tokens' places to the model.
    """
    out = dict(batch)
    if layout == "balanced" and cp_size > 1:  # each sample's own chunks, chosen from its documents
        documents = out["document_ids"]
        check_cp_split(documents.shape[-1], cp_size, layout)
        rows = documents.reshape(-1, documents.shape[-1])
        positions = rank_positions(rows, cp_size, layout)[cp_rank].reshape(*documents.shape[:-1], -1)
        for key in PER_TOKEN_KEYS:
            if key in out:
                out[key] = torch.gather(out[key], -1, positions)
        return out
    for key in PER_TOKEN_KEYS:
        if key in out:
            check_cp_split(out[key].shape[-1], cp_size, layout)
            if cp_size > 1:
                out[key] = shard_sequence(out[key], cp_rank, cp_size, layout, dim=-1)
    return out


def check_cp_split(seq_len: int, cp_size: int, layout: str) -> None:
    """``ValueError`` (saying what to change) unless ``seq_len`` splits over ``cp_size`` ranks.

    With ``cp_size == 1`` nothing is split, so any ``seq_len`` works.
    """
    check_layout_name(layout)
    if cp_size != 1:
        check_layout(seq_len, cp_size, layout)


class DataParallelSampler:
    """Sample ids of one DP rank, one step at a time, from ``consumed_samples`` on.

    Iterating yields, per optimizer step, ``grad_accum_steps`` lists of ``micro_batch_size``
    sample ids; it stops before a step that would run past ``total_samples``.
    """

    def __init__(self, total_samples: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0) -> None:
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside the DP group of size {dp_size}")
        per_micro_step = micro_batch_size * dp_size
        if global_batch_size < per_micro_step or global_batch_size % per_micro_step:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of "
                f"micro_batch_size * dp_size = {per_micro_step} (global batch = micro batch * dp * "
                f"gradient accumulation steps); change one of them")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside the dataset's "
                             f"{total_samples} samples; build the dataset with more samples")
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.grad_accum_steps = global_batch_size // per_micro_step

    def step_micro_batches(self, step_start: int) -> list[list[int]]:
        """This rank's micro-batches of the global batch that starts at sample ``step_start``."""
        mbs, dp = self.micro_batch_size, self.dp_size
        return [[step_start + m * mbs * dp + self.dp_rank * mbs + i for i in range(mbs)]
                for m in range(self.grad_accum_steps)]

    def __len__(self) -> int:
        """Steps left."""
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def __iter__(self) -> Iterator[list[list[int]]]:
        for step in range(len(self)):
            yield self.step_micro_batches(self.consumed_samples + step * self.global_batch_size)


class _MicroBatches:
    """The sampler's steps flattened into micro-batches (a DataLoader batch_sampler)."""

    def __init__(self, sampler: DataParallelSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler) * self.sampler.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.sampler:
            yield from step


def rank_positions(document_ids: torch.Tensor, cp_size: int, layout: str) -> torch.Tensor:
    """Which sequence positions every CP rank keeps of each row of ``document_ids`` ``[B, seq_len]``:
    ``[cp_size, B, seq_len // cp_size]`` (``slice_for_context_parallel``'s choice, for every rank at once)."""
    batch, seq_len = document_ids.shape
    if cp_size == 1:
        return torch.arange(seq_len).expand(1, batch, -1)
    if layout == "balanced":
        return torch.stack([balanced_positions(row, cp_size) for row in document_ids], dim=1)
    every = torch.stack([sequence_positions(seq_len, r, cp_size, layout) for r in range(cp_size)])
    return every[:, None].expand(cp_size, batch, -1)


class CollateForContextParallel:
    """Stack samples into a micro-batch (``[B, seq_len]``), then keep this CP rank's slice.

    With a ``planner`` (``cp_train.parallel.cp.plan.batch_plan.SamplePlanner``) the micro-batch also carries, under
    ``CP_PLAN``, the per-document CP plan built from every CP rank's ``document_ids`` and
    ``position_ids`` (``[cp, B, seq_len // cp]``, rank order), here where the whole sample is at hand."""

    def __init__(self, cp_rank: int, cp_size: int, layout: str,
                 planner: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> None:
        self.cp_rank, self.cp_size, self.layout, self.planner = cp_rank, cp_size, layout, planner

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        batch = default_collate(samples)
        if self.planner is None:
            return slice_for_context_parallel(batch, self.cp_rank, self.cp_size, self.layout)
        index = rank_positions(batch["document_ids"], self.cp_size, self.layout)  # [cp, B, seq_len // cp]
        out = {key: torch.gather(value, -1, index[self.cp_rank]) if key in PER_TOKEN_KEYS else value
               for key, value in batch.items()}
        every = [torch.gather(batch[key].expand(self.cp_size, *batch[key].shape), 2, index)
                 for key in ("document_ids", "position_ids")]  # every rank's, as the all-gather would give
        out[CP_PLAN] = self.planner(*every)
        return out


class StepLoader:
    """Yields one list of ``grad_accum_steps`` micro-batch dicts per optimizer step.

    ``consumed_samples`` advances by ``global_batch_size`` as each step is handed out; save it
    (``state_dict()``) with the checkpoint and pass it back to ``build_data_loader`` to resume.
    """

    def __init__(self, sampler: DataParallelSampler, loader: DataLoader) -> None:
        self.sampler = sampler
        self.loader = loader
        self.consumed_samples = sampler.consumed_samples

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        step: list[dict[str, torch.Tensor]] = []
        for micro_batch in self.loader:
            step.append(micro_batch)
            if len(step) == self.sampler.grad_accum_steps:
                self.consumed_samples += self.sampler.global_batch_size
                yield step
                step = []

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


def build_data_loader(dataset: Dataset, micro_batch_size: int, global_batch_size: int,
                      dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
                      layout: str = "zigzag", consumed_samples: int = 0,
                      num_workers: int = 0, pin_memory: bool = False,
                      planner: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> StepLoader:
    """A ``StepLoader`` over ``dataset`` for one (DP rank, CP rank).

    Micro-batch tensors are ``[micro_batch_size, seq_len // cp_size]`` (per-token keys). With
    ``num_workers`` > 0, worker processes prepare the next micro-batches while the current step
    runs; ``pin_memory`` puts them in page-locked memory so the copy to a GPU can be asynchronous.
    ``planner``: see ``CollateForContextParallel`` (the plan is then made in the workers too).
    Raises ``ValueError`` early when ``seq_len`` does not split over ``cp_size`` for ``layout``
    or the batch sizes do not divide.
    """
    seq_len = getattr(dataset, "seq_len", None)
    if seq_len is None:
        seq_len = int(dataset[0]["tokens"].shape[-1])
    check_cp_split(seq_len, cp_size, layout)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside the CP group of size {cp_size}")
    total = len(dataset)
    if total < global_batch_size:
        raise ValueError(f"the dataset has {total} samples, fewer than one global batch of "
                         f"{global_batch_size}; build it with more samples")
    sampler = DataParallelSampler(total, micro_batch_size, global_batch_size, dp_rank, dp_size,
                                  consumed_samples)
    loader = DataLoader(dataset, batch_sampler=_MicroBatches(sampler), num_workers=num_workers,
                        collate_fn=CollateForContextParallel(cp_rank, cp_size, layout, planner),
                        pin_memory=pin_memory, persistent_workers=False)
    return StepLoader(sampler, loader)
