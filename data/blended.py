"""Blend several datasets by weight into one deterministic stream of samples.

``data.prefix`` names one dataset or a blend in Megatron-LM's ``--data-path`` form, ``W1 PREFIX1 W2 PREFIX2 ...``
(``parse_blend``).

Sample ``k`` of dataset ``d`` is placed at the ideal time ``(k + 0.5) / w_d`` (weights normalised)
and all samples are served in order of that time (ties: lower dataset first). Every prefix of
the stream holds each dataset within ``(D - 1) / 2`` samples of its exact share for ``D >= 2``
datasets (half a sample for two), with no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


def parse_blend(spec: str) -> tuple[tuple[float, str], ...]:
    """``(weight, prefix)`` pairs of ``data.prefix``: one prefix (weight 1; also one whose path holds spaces, when its
    ``.idx`` exists), or ``W1 PREFIX1 W2 PREFIX2 ...`` with positive weights (normalised where used). ``ValueError``
    with the form to use otherwise."""
    words = spec.split()
    if len(words) == 1 or (len(words) > 1 and Path(spec + ".idx").is_file()):
        return ((1.0, spec.strip()),)
    pairs: list[tuple[float, str]] = []
    if words and len(words) % 2 == 0:
        try:
            pairs = [(float(words[i]), words[i + 1]) for i in range(0, len(words), 2)]
        except ValueError:
            pairs = []
    if not pairs or not all(math.isfinite(weight) and weight > 0 for weight, _ in pairs):
        raise ValueError(f"data.prefix {spec!r}: a blend of datasets is 'WEIGHT PREFIX WEIGHT PREFIX ...' with "
                         f"positive weights (as Megatron-LM's --data-path 0.7 data/web 0.3 data/code); one dataset "
                         f"is its prefix alone")
    return tuple(pairs)


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample id within that dataset) for each of ``num_samples`` samples (int64)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    w = w / w.sum()
    times, dataset_ids, sample_ids = [], [], []
    for d, share in enumerate(w):
        if share == 0:
            continue
        count = int(np.ceil(share * num_samples + len(w) / 2)) + 1  # > any prefix can take
        k = np.arange(count, dtype=np.int64)
        times.append((k + 0.5) / share)
        dataset_ids.append(np.full(count, d, dtype=np.int64))
        sample_ids.append(k)
    order = np.lexsort((np.concatenate(dataset_ids), np.concatenate(times)))[:num_samples]
    return np.concatenate(dataset_ids)[order], np.concatenate(sample_ids)[order]


Schedule = tuple[np.ndarray, np.ndarray]  # blend_schedule's (dataset ids, sample ids)


def blended_sample_counts(weights: Sequence[float], num_samples: int, schedule: Schedule | None = None) -> list[int]:
    """How many samples each dataset must have for a blend of ``num_samples`` (from ``schedule``, the blend's
    ``blend_schedule`` when already made)."""
    dataset_ids, _ = schedule if schedule is not None else blend_schedule(weights, num_samples)
    return np.bincount(dataset_ids, minlength=len(weights)).tolist()


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``.

    Build each dataset with at least ``blended_sample_counts(weights, num_samples)[d]`` samples; ``schedule``: the
    ``blend_schedule(weights, num_samples)`` those counts were taken from (made once, not again here).
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float],
                 num_samples: int, schedule: Schedule | None = None) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        schedule = schedule if schedule is not None else blend_schedule(weights, num_samples)
        self.dataset_ids, self.sample_ids = schedule
        needed = blended_sample_counts(weights, num_samples, schedule)
        for d, (dataset, count) in enumerate(zip(self.datasets, needed, strict=True)):
            if len(dataset) < count:
                raise ValueError(f"blended dataset {d} has {len(dataset)} samples but the blend "
                                 f"needs {count}; build it with num_samples >= {count}")
        seq_lens = {getattr(ds, "seq_len", None) for ds in self.datasets}
        if len(seq_lens) > 1:
            raise ValueError(f"blended datasets have different seq_len: {sorted(map(str, seq_lens))}")
        self.seq_len = seq_lens.pop()
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside the {self.num_samples} samples")
        return self.datasets[int(self.dataset_ids[index])][int(self.sample_ids[index])]
