"""The three index arrays behind a GPT dataset (as Megatron's GPTDataset), and their on-disk cache.

- document index ``int64[E * D]``: the dataset's documents (sequence ids of the indexed data)
  repeated for ``E`` epochs, each epoch in its own shuffled order;
- sample index ``int64[M + 1, 2]``: row ``j`` is ``(position in the document index, token
  offset)`` where sample ``j`` starts; sample ``j`` is the ``seq_len + 1`` tokens of the
  concatenated shuffled documents from token ``j * seq_len`` on (consecutive samples share one
  token: the last label of one is the first input of the next);
- shuffle index ``int64[N]``: the order the dataset serves the samples: the samples are cut into
  blocks of one epoch's worth (``tokens per epoch // seq_len`` samples) and each block is shuffled
  on its own; ``M`` covers the blocks the ``N`` samples reach.

Epoch ``e``'s document order and block ``b``'s shuffle are drawn from their own generators, seeded by
``(seed, e)`` and ``(seed, b)``: the first ``k`` samples are the same whatever ``N`` is, so a run that
trains longer (more samples) continues the very same stream.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cp_train.data.indexed import index_path, partial_name

CACHE_FORMAT = 2  # 2: epochs and sample blocks seeded one by one
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@dataclass(frozen=True)
class SampleIndices:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray


def epochs_needed(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Epochs whose tokens cover ``num_samples`` samples of ``seq_len + 1`` tokens."""
    needed = num_samples * seq_len + 1
    return -(-needed // tokens_per_epoch)


def samples_per_block(tokens_per_epoch: int, seq_len: int) -> int:
    """Samples shuffled together: one epoch's worth (at least 1)."""
    return max(1, tokens_per_epoch // seq_len)


def _generator(seed: int, stream: int, index: int) -> np.random.Generator:
    """The generator of epoch (``stream`` 0) or sample block (``stream`` 1) ``index``."""
    return np.random.default_rng([seed % 2**64, stream, index])


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int,
                  seed: int) -> SampleIndices:
    """The three indices for ``documents`` (ids into ``sizes``, the token count per sequence); the first
    ``k`` entries of the served order do not depend on ``num_samples``."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    block = samples_per_block(tokens_per_epoch, seq_len)
    blocks = -(-num_samples // block)
    indexed_samples = blocks * block
    num_epochs = epochs_needed(tokens_per_epoch, seq_len, indexed_samples)
    document_index = np.concatenate(
        [documents[_generator(seed, 0, e).permutation(len(documents))] for e in range(num_epochs)]
    ).astype(np.int64)
    token_ends = np.cumsum(sizes[document_index].astype(np.int64))
    token_starts = np.concatenate([[0], token_ends[:-1]])
    first_token = np.arange(indexed_samples + 1, dtype=np.int64) * seq_len
    # the document holding a token is the last one starting at or before it (skips empty ones)
    position = np.searchsorted(token_ends, first_token, side="right")
    sample_index = np.stack([position, first_token - token_starts[position]], axis=1)
    shuffle_index = np.concatenate(
        [b * block + _generator(seed, 1, b).permutation(block) for b in range(blocks)])[:num_samples]
    return SampleIndices(document_index, sample_index.astype(np.int64), shuffle_index.astype(np.int64))


def cache_key(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int,
              seed: int) -> str:
    """Hex digest of everything the indices depend on: documents, their sizes, the parameters."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(documents, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(sizes[documents], dtype=np.int64).tobytes())
    digest.update(json.dumps({"format": CACHE_FORMAT, "seq_len": seq_len,
                              "num_samples": num_samples, "seed": seed}).encode())
    return digest.hexdigest()[:20]


def cache_dir_of(cache_dir: str | Path | None, prefix: str | Path) -> Path:
    """Where the caches of the dataset at ``prefix`` go: ``cache_dir`` (``data.cache_dir``), else beside its files."""
    return Path(cache_dir) if cache_dir is not None else index_path(prefix).parent


def cache_paths(cache_dir: Path, stem: str) -> dict[str, Path]:
    return {name: cache_dir / f"{stem}.{name}.npy" for name in INDEX_NAMES}


def load_cached(cache_dir: Path, stem: str) -> SampleIndices | None:
    """The cached indices (memory-mapped), or None when any file is missing."""
    paths = cache_paths(cache_dir, stem)
    if not all(p.is_file() for p in paths.values()):
        return None
    return SampleIndices(**{name: np.load(path, mmap_mode="r") for name, path in paths.items()})


def save_cached(cache_dir: Path, stem: str, indices: SampleIndices, description: dict) -> None:
    """Write the three ``.npy`` files (each atomically) and a human-readable ``.json``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for name, path in cache_paths(cache_dir, stem).items():
        partial = partial_name(path)
        with open(partial, "wb") as handle:
            np.save(handle, getattr(indices, name))
        os.replace(partial, path)
    (cache_dir / f"{stem}.json").write_text(json.dumps(description, indent=2) + "\n")
