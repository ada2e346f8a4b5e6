"""Blend several datasets by weight into one deterministic stream of samples.

``data.prefix`` (and ``data.valid_prefix``) names one dataset or a blend in Megatron-LM's ``--data-path`` form,
``W1 PREFIX1 W2 PREFIX2 ...``, or ``PREFIX1 PREFIX2 ...`` weighed by their tokens (``parse_blend``).

Sample ``k`` of dataset ``d`` is placed at the ideal time ``(k + 0.5) / w_d`` (weights normalised)
and all samples are served in order of that time (ties: lower dataset first). Every prefix of
the stream holds each dataset within ``(D - 1) / 2`` samples of its exact share for ``D >= 2``
datasets (half a sample for two), with no randomness. The schedule of a run is made once per node and kept beside
the sample indices (``cached_blend_schedule``), memory-mapped by every rank in 6 bytes a sample; it is made window
by window of ideal time straight into those files, so making it holds one window (``WINDOW_SAMPLES``) in memory
whatever the run's length.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cp_train.data.indexed import partial_name

WINDOW_SAMPLES = 1 << 20  # samples per window of ideal time the schedule is sorted in (~50 bytes each at work)


def _shares(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    return w / w.sum()


def _fill_schedule(share: np.ndarray, dataset_ids: np.ndarray, sample_ids: np.ndarray) -> None:
    """Write the schedule of ``share`` (normalised weights) into ``dataset_ids`` and ``sample_ids`` (1-D, one entry
    per sample; any integer dtypes, memory-mapped files too), window by window of ideal time: each window's samples
    (times in ``[end - WINDOW_SAMPLES, end)``, about that many: the shares sum to one sample per unit of time) are
    sorted on (time, dataset) apart, the same order as one sort of them all, with one window's memory at work."""
    num_samples, taken, written, end = len(dataset_ids), np.zeros(len(share), dtype=np.int64), 0, 0.0
    while written < num_samples:
        end += WINDOW_SAMPLES
        times, ids, ks = [], [], []
        for d, rate in enumerate(share):
            if rate == 0:
                continue
            k = np.arange(taken[d], max(taken[d], int(np.ceil(end * rate)) + 1), dtype=np.int64)
            t = (k + 0.5) / rate  # non-decreasing in k: the window takes a prefix of the candidates
            inside = int(np.searchsorted(t, end, side="left"))
            times.append(t[:inside])
            ks.append(k[:inside])
            ids.append(np.full(inside, d, dtype=np.int64))
            taken[d] += inside
        window_ids, window_ks = np.concatenate(ids), np.concatenate(ks)
        order = np.lexsort((window_ids, np.concatenate(times)))[:num_samples - written]
        dataset_ids[written:written + len(order)] = window_ids[order]
        sample_ids[written:written + len(order)] = window_ks[order]
        written += len(order)


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample id within that dataset) for each of ``num_samples`` samples (int64)."""
    share = _shares(weights)
    dataset_ids, sample_ids = np.empty(num_samples, dtype=np.int64), np.empty(num_samples, dtype=np.int64)
    _fill_schedule(share, dataset_ids, sample_ids)
    return dataset_ids, sample_ids


Schedule = tuple[np.ndarray, np.ndarray]  # blend_schedule's (dataset ids, sample ids)


BLEND_CACHE_FORMAT = 1


def cached_blend_schedule(weights: Sequence[float], num_samples: int, cache_dir: Path, name: str) -> Schedule:
    """``blend_schedule(weights, num_samples)`` from ``cache_dir``, memory-mapped, where a run saved it before (the
    first rank of a node makes it, the others read it: ``cp_train/build.py``); made and saved there otherwise. Stored
    compact: dataset ids in int16 (int32 beyond 32,767 datasets), sample ids in int32 (int64 past 2^31); ``name``
    (train, valid) names the files, ``blend.<name>.<key>.{dataset_ids,sample_ids}.npy``."""
    description = {"format": BLEND_CACHE_FORMAT, "weights": [float(w) for w in weights], "num_samples": num_samples}
    key = hashlib.sha256(json.dumps(description).encode()).hexdigest()[:20]
    paths = [cache_dir / f"blend.{name}.{key}.{part}.npy" for part in ("dataset_ids", "sample_ids")]
    if all(path.is_file() for path in paths):
        return tuple(np.load(path, mmap_mode="r") for path in paths)  # type: ignore[return-value]
    share = _shares(weights)
    largest = num_samples + len(weights) + 1  # a sample id is below any dataset's count of samples (<= this)
    dtypes = (np.int16 if len(weights) <= np.iinfo(np.int16).max else np.int32,
              np.int32 if largest <= np.iinfo(np.int32).max else np.int64)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partials = [partial_name(path) for path in paths]
    arrays = [np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=(num_samples,))
              for partial, dtype in zip(partials, dtypes, strict=True)]
    _fill_schedule(share, *arrays)  # straight into the files: no copy of the schedule in memory
    for array in arrays:
        array.flush()
    del arrays
    for partial, path in zip(partials, paths, strict=True):
        os.replace(partial, path)
    return tuple(np.load(path, mmap_mode="r") for path in paths)  # type: ignore[return-value]


def blended_sample_counts(weights: Sequence[float], num_samples: int, schedule: Schedule | None = None) -> list[int]:
    """How many samples each dataset must have for a blend of ``num_samples`` (from ``schedule``, the blend's
    ``blend_schedule`` when already made)."""
    dataset_ids, _ = schedule if schedule is not None else blend_schedule(weights, num_samples)
    counts = np.zeros(len(weights), dtype=np.int64)
    for start in range(0, len(dataset_ids), WINDOW_SAMPLES):  # bincount copies its input to int64: a window at once
        counts += np.bincount(dataset_ids[start:start + WINDOW_SAMPLES], minlength=len(weights))
    return counts.tolist()


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
