"""GPT pretraining samples cut from an indexed dataset, plus a train/valid split by fraction.

A sample is ``seq_len + 1`` consecutive tokens of the shuffled documents (cut across document
boundaries); ``dataset[i]`` is a dict of tensors, all of shape ``[seq_len]``:

- ``tokens`` int64: inputs, ``sample[:-1]``;
- ``labels`` int64: targets, ``sample[1:]``;
- ``loss_mask`` float32: 1 where the label counts; 0 where the input is EOD (``mask_eod_loss``)
  or the label is padding (``pad_id``);
- ``position_ids`` int64: ``0 .. seq_len-1``, or restarting at 0 at each document start
  (``reset_position_ids``);
- ``document_ids`` int64: which document piece each input token belongs to, numbered 0, 1, ...
  from the start of the sample: the document boundaries, per token, so they follow the tokens
  through the CP split. ``cu_seqlens(document_ids)`` turns them into flash-attn style offsets.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from cp_train.data.indexed import IndexedDataset
from cp_train.data.sample_index import (
    SampleIndices,
    build_indices,
    cache_dir_of,
    cache_key,
    load_cached,
    save_cached,
)

PER_TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


def split_documents(num_documents: int, fractions: list[float] | tuple[float, ...]) -> list[np.ndarray]:
    """Cut documents ``0 .. num_documents-1`` into consecutive ranges, one per fraction.

    Fractions are normalised (``(98, 2)`` works like ``(0.98, 0.02)``); boundaries are rounded.
    """
    weights = np.asarray(fractions, dtype=np.float64)
    if weights.ndim != 1 or weights.size == 0 or np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError(f"split fractions {fractions} must be non-negative with a positive sum")
    bounds = np.round(np.concatenate([[0.0], np.cumsum(weights / weights.sum())]) * num_documents)
    bounds = bounds.astype(np.int64)
    bounds[-1] = num_documents
    return [np.arange(lo, hi, dtype=np.int64) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def train_valid_split(num_documents: int, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train documents, valid documents): the last ``valid_fraction`` of documents is valid."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    train, valid = split_documents(num_documents, (1.0 - valid_fraction, valid_fraction))
    return train, valid


def cu_seqlens(document_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries over the flattened tokens, flash-attn style (int32).

    ``document_ids`` is ``[S]`` or ``[B, S]`` (global, before the CP split); every row starts a
    new document. Returns ``[0, end of first document, ..., B*S]``.
    """
    ids = document_ids.reshape(-1, document_ids.shape[-1])
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    offsets = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([offsets, offsets.new_tensor([ids.numel()])]).to(torch.int32)


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_len + 1`` tokens from ``documents`` of ``indexed``.

    ``documents`` are sequence ids of ``indexed`` (default: all; see ``split_documents``). The
    indices are cached as ``.npy`` files in ``cache_dir`` (default: next to the data) under a
    name hashed from everything they depend on; ``loaded_from_cache`` says whether this
    instance loaded them instead of building them. Shuffling is seeded by ``seed``.
    """

    def __init__(self, indexed: IndexedDataset, seq_len: int, num_samples: int, seed: int = 1234,
                 *, documents: np.ndarray | None = None, eod_id: int | None = None,
                 pad_id: int | None = None, mask_eod_loss: bool = False,
                 reset_position_ids: bool = False, cache_dir: str | os.PathLike | None = None,
                 name: str = "train") -> None:
        if seq_len < 1 or num_samples < 1:
            raise ValueError(f"seq_len ({seq_len}) and num_samples ({num_samples}) must be >= 1")
        if mask_eod_loss and eod_id is None:
            raise ValueError("mask_eod_loss=True needs eod_id (Tokenizer.eod)")
        self.indexed = indexed
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.eod_id, self.pad_id = eod_id, pad_id
        self.mask_eod_loss, self.reset_position_ids = mask_eod_loss, reset_position_ids
        self.name = name
        sizes = indexed.sequence_lengths
        if documents is None:
            documents = np.arange(len(indexed), dtype=np.int64)
        documents = np.asarray(documents, dtype=np.int64)
        if documents.size == 0:
            raise ValueError(f"the {name} split of {indexed.prefix} has no documents; give it a "
                             f"larger fraction or use more data")
        available = int(sizes[documents].astype(np.int64).sum())
        if available < seq_len + 1:
            raise ValueError(
                f"the {name} split of {indexed.prefix} has {available} tokens, fewer than one "
                f"sample of seq_len + 1 = {seq_len + 1}; use a shorter seq_len, a larger split "
                f"fraction or more data")
        self.cache_dir = cache_dir_of(cache_dir, indexed.prefix)
        key = cache_key(sizes, documents, seq_len, num_samples, seed)
        self.cache_stem = f"{Path(indexed.prefix).name}.{name}.{key}"
        cached = load_cached(self.cache_dir, self.cache_stem)
        self.loaded_from_cache = cached is not None
        if cached is None:
            cached = build_indices(sizes, documents, seq_len, num_samples, seed)
            save_cached(self.cache_dir, self.cache_stem, cached, {
                "data": str(indexed.prefix), "name": name, "seq_len": seq_len,
                "num_samples": num_samples, "seed": seed, "documents": int(documents.size),
                "epochs": int(cached.document_index.size // documents.size)})
        self.indices: SampleIndices = cached

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, index: int) -> tuple[np.ndarray, list[int]]:
        """The ``seq_len + 1`` tokens of sample ``index`` (int64) and the length of each piece."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside the {self.num_samples} samples")
        sample = int(self.indices.shuffle_index[index])
        position, offset = (int(v) for v in self.indices.sample_index[sample])
        sizes, document_index = self.indexed.sequence_lengths, self.indices.document_index
        pieces: list[np.ndarray] = []
        lengths: list[int] = []
        remaining = self.seq_len + 1
        while remaining > 0:
            sequence = int(document_index[position])
            take = min(int(sizes[sequence]) - offset, remaining)
            if take > 0:
                pieces.append(self.indexed.get(sequence, offset, take))
                lengths.append(take)
                remaining -= take
            position, offset = position + 1, 0
        return np.concatenate(pieces).astype(np.int64), lengths

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample, lengths = self.sample_tokens(index)
        seq_len = self.seq_len
        tokens, labels = sample[:-1], sample[1:]
        document_ids = np.repeat(np.arange(len(lengths)), lengths)[:seq_len]
        positions = np.arange(seq_len)
        if self.reset_position_ids:
            starts = np.cumsum([0] + lengths[:-1])
            positions = positions - starts[document_ids]
        loss_mask = np.ones(seq_len, dtype=np.float32)
        if self.mask_eod_loss:
            loss_mask[tokens == self.eod_id] = 0.0
        if self.pad_id is not None:
            loss_mask[labels == self.pad_id] = 0.0
        as_int64 = lambda array: torch.from_numpy(np.array(array, dtype=np.int64))  # a copy
        return {"tokens": as_int64(tokens), "labels": as_int64(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": as_int64(positions),
                "document_ids": as_int64(document_ids)}
