"""The three index arrays behind a GPT dataset (as Megatron's GPTDataset), and their on-disk cache.

- document index ``int32[E * D]``: the dataset's documents (sequence ids of the indexed data)
  repeated for ``E`` epochs, each epoch in its own shuffled order;
- sample index ``int32[M + 1, 2]``: row ``j`` is ``(position in the document index, token
  offset)`` where sample ``j`` starts; sample ``j`` is the ``seq_len + 1`` tokens of the
  concatenated shuffled documents from token ``j * seq_len`` on (consecutive samples share one
  token: the last label of one is the first input of the next);
- shuffle index ``int32[N]``: the order the dataset serves the samples: the samples are cut into
  blocks of one epoch's worth (``tokens per epoch // seq_len`` samples) and each block is shuffled
  on its own; ``M`` covers the blocks the ``N`` samples reach.

Epoch ``e``'s document order and block ``b``'s shuffle are drawn from their own generators, seeded by
``(seed, e)`` and ``(seed, b)``: the first ``k`` samples are the same whatever ``N`` is, so a run that
trains longer (more samples) continues the very same stream. Each index is int64 instead where its values pass
2^31 - 1 (``index_dtype``), as Megatron's helpers keep them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cp_train.data.indexed import index_path, partial_name

CACHE_FORMAT = 3  # 2: epochs and sample blocks seeded one by one; 3: int32 where the values fit
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


def index_dtype(largest: int) -> type[np.signedinteger]:
    """int32 for values up to ``largest``, else int64 (Megatron's indices are int32 where they fit)."""
    return np.int32 if largest < np.iinfo(np.int32).max else np.int64


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int,
                  seed: int) -> SampleIndices:
    """The three indices for ``documents`` (ids into ``sizes``, the token count per sequence); the first
    ``k`` entries of the served order do not depend on ``num_samples``. Each index is int32 where its values fit
    (int64 beyond), and the sample index is found ``CHUNK_DOCUMENTS`` documents at a time: memory holds the
    indices (about 12 bytes a sample and 4 a document per epoch) and one chunk at work."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    block = samples_per_block(tokens_per_epoch, seq_len)
    blocks = -(-num_samples // block)
    indexed_samples = blocks * block
    num_epochs = epochs_needed(tokens_per_epoch, seq_len, indexed_samples)
    document_index = np.empty(num_epochs * len(documents), dtype=index_dtype(len(sizes)))
    for e in range(num_epochs):
        document_index[e * len(documents):(e + 1) * len(documents)] = \
            documents[_generator(seed, 0, e).permutation(len(documents))]
    longest = int(sizes[documents].max(initial=0))  # an offset is inside its document
    sample_index = np.empty((indexed_samples + 1, 2), dtype=index_dtype(max(len(document_index), longest)))
    _fill_sample_index(sizes, document_index, seq_len, sample_index)
    shuffle_index = np.empty(num_samples, dtype=index_dtype(indexed_samples))
    for b in range(blocks):
        order = b * block + _generator(seed, 1, b).permutation(block)
        shuffle_index[b * block:(b + 1) * block] = order[:max(0, num_samples - b * block)]
    return SampleIndices(document_index, sample_index, shuffle_index)


CHUNK_DOCUMENTS = 1 << 22  # documents whose token ends are held at once while the sample index is found


def _fill_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_len: int, out: np.ndarray) -> None:
    """Row ``j`` of ``out`` (``[M + 1, 2]``): the position in ``document_index`` of the document holding token
    ``j * seq_len`` of the concatenated documents (the last one starting at or before it: empty ones are skipped)
    and the token's offset in it. The documents' token ends are found a chunk at a time; each chunk places the
    samples whose first token lies inside it."""
    done, carried = 0, 0  # rows placed; tokens before the chunk
    for start in range(0, len(document_index), CHUNK_DOCUMENTS):
        lengths = sizes[document_index[start:start + CHUNK_DOCUMENTS]].astype(np.int64)
        ends = carried + np.cumsum(lengths)
        inside = min(len(out), (int(ends[-1]) - 1) // seq_len + 1)  # the rows j with j * seq_len < the chunk's end
        first = np.arange(done, inside, dtype=np.int64) * seq_len
        position = np.searchsorted(ends, first, side="right")
        out[done:inside, 0] = start + position
        out[done:inside, 1] = first - (ends[position] - lengths[position])
        done, carried = max(done, inside), int(ends[-1])
    if done != len(out):
        raise ValueError(f"the documents hold {carried} tokens, too few for {len(out) - 1} samples of {seq_len}")


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
