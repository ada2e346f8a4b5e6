"""Megatron-compatible indexed dataset: a ``PREFIX.bin`` of tokens and a ``PREFIX.idx`` index.

``.bin``: the tokens of every sequence, back to back, in one numpy dtype, no header.

``.idx`` (all little-endian), the layout Megatron-LM's ``indexed_dataset.py`` reads and writes:

====================  =====================================================================
9 bytes               magic ``b"MMIDIDX\\x00\\x00"``
``<Q``                version, always 1
``<B``                dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                      7 float32, 8 uint16
``<Q``                sequence count ``S``
``<Q``                length of the document index ``D`` (= number of documents + 1)
``int32[S]``          tokens per sequence
``int64[S]``          byte offset of each sequence in ``.bin``
``int64[D]``          document index: document ``d`` is sequences ``[doc[d], doc[d+1])``;
                      starts with 0 and ends with ``S``
====================  =====================================================================

Every document written by this project is one sequence, so ``D = S + 1``; files where a
document spans several sequences (Megatron's sentence splitting) load as well.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
    8: np.uint16,
}

PathLike = str | os.PathLike


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's numeric code for a numpy dtype (``ValueError`` if it has none)."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no Megatron dtype code; use one of "
                     f"{', '.join(np.dtype(d).name for d in DTYPE_CODES.values())}")


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule: ``vocab_size < 65500``), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_path(prefix: PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def index_path(prefix: PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def check_vocab_fits(dtype: np.dtype | type, vocab_size: int, what: str = "the data") -> None:
    """Raise ``ValueError`` unless token ids ``0 .. vocab_size-1`` fit in ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise ValueError(f"{what} stores {dtype.name} values, not integer token ids")
    largest = int(np.iinfo(dtype).max)
    if vocab_size - 1 > largest:
        raise ValueError(
            f"a tokenizer with {vocab_size} ids does not fit {what}, stored as {dtype.name} "
            f"(largest id {largest}); re-run cp-train-preprocess with this tokenizer so the tokens are "
            f"written as int32, or use the tokenizer the data was made with")


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin`` as documents arrive and ``PREFIX.idx`` on ``finalize()``.

    Use as a context manager (``finalize`` runs on a clean exit, ``abort`` on an exception). Both
    files are written under temporary names next to their final ones and renamed into place by
    ``finalize`` (``.bin`` first, ``.idx`` last), so a failed or interrupted run never leaves a
    ``.bin`` without its ``.idx``. Token values are checked against the dtype's range, so ids never
    wrap around silently.
    """

    def __init__(self, prefix: PathLike, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._sequence_lengths: list[int] = []
        self._document_index: list[int] = [0]
        self._partial = {"bin": partial_name(data_path(self.prefix)),
                         "idx": partial_name(index_path(self.prefix))}
        self._bin = open(self._partial["bin"], "wb")  # closed in finalize() or abort()
        self._finalized = False

    def add_document(self, tokens: Iterable[int] | np.ndarray,
                     sequence_lengths: Iterable[int] | None = None) -> None:
        """Append one document: ``tokens`` (1-D), optionally cut into several sequences."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D token array, got shape {array.shape}")
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids {low}..{high} do not fit {self.dtype.name} (range {info.min}.."
                    f"{info.max}) in {data_path(self.prefix)}; write with dtype=int32 "
                    f"(token_dtype_for_vocab gives the right dtype for a vocab size)")
        lengths = [array.size] if sequence_lengths is None else [int(n) for n in sequence_lengths]
        if sum(lengths) != array.size or any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths {lengths} do not add up to the {array.size} tokens")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sequence_lengths.extend(lengths)
        self._document_index.append(len(self._sequence_lengths))

    def finalize(self) -> None:
        """Close ``.bin``, write ``.idx`` and rename both into place (idempotent)."""
        if self._finalized:
            return
        self._finalized = True
        self._bin.close()
        lengths = np.asarray(self._sequence_lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            self.abort()
            raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed")
        try:
            with open(self._partial["idx"], "wb") as out:
                out.write(INDEX_MAGIC)
                out.write(struct.pack("<Q", INDEX_VERSION))
                out.write(struct.pack("<B", self._code))
                out.write(struct.pack("<Q", len(lengths)))
                out.write(struct.pack("<Q", len(self._document_index)))
                out.write(lengths.astype("<i4").tobytes())
                out.write(pointers.astype("<i8").tobytes())
                out.write(np.asarray(self._document_index, dtype="<i8").tobytes())
        except BaseException:
            self.abort()
            raise
        os.replace(self._partial["bin"], data_path(self.prefix))
        os.replace(self._partial["idx"], index_path(self.prefix))

    def abort(self) -> None:
        """Close and delete the temporary files; the final ones are left as they were (idempotent)."""
        self._finalized = True
        self._bin.close()
        for partial in self._partial.values():
            partial.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def partial_name(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: the same directory, hidden, its own per process
    and host (nodes that share a file system build the same cache files at once, and containers repeat pids)."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx`` (memory-mapped).

    ``ds[i]`` is sequence ``i`` as a 1-D array of ``ds.dtype``; ``ds.get(i, offset, length)``
    a part of it. Missing, truncated or malformed files raise an error naming the file.
    """

    def __init__(self, prefix: PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx_file, bin_file = index_path(self.prefix), data_path(self.prefix)
        for path in (idx_file, bin_file):
            if not path.is_file():
                hint = (f": pass the dataset's prefix without .bin or .idx ({self.prefix[:-4]})"
                        if self.prefix.endswith((".bin", ".idx")) else
                        f"; an indexed dataset needs both {idx_file.name} and {bin_file.name} (make them with "
                        f"cp-train-preprocess)")
                raise FileNotFoundError(f"{path} is missing{hint}")
        self._read_index(idx_file)
        self._check_data_size(bin_file)
        self._bin_path = bin_file
        self._tokens = self._map_tokens()

    def _read_index(self, idx_file: Path) -> None:
        size = idx_file.stat().st_size
        if size < HEADER_BYTES:
            raise ValueError(f"{idx_file} is truncated: {size} bytes, the header alone is "
                             f"{HEADER_BYTES}; rebuild it with cp-train-preprocess")
        raw = np.memmap(idx_file, dtype=np.uint8, mode="r")
        header = raw[:HEADER_BYTES].tobytes()
        if header[:9] != INDEX_MAGIC:
            raise ValueError(f"{idx_file} is not a Megatron MMIDIDX index (magic {header[:9]!r})")
        version, code = struct.unpack_from("<QB", header, 9)
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_file} has index version {version}; only version 1 is supported")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_file} has unknown dtype code {code}")
        sequences, doc_entries = struct.unpack_from("<QQ", header, 18)
        needed = HEADER_BYTES + 4 * sequences + 8 * sequences + 8 * doc_entries
        if raw.size < needed:
            raise ValueError(f"{idx_file} is truncated: {raw.size} bytes, its header announces "
                             f"{needed}; rebuild it with cp-train-preprocess")
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = HEADER_BYTES
        self.sequence_lengths = raw[offset:offset + 4 * sequences].view("<i4")
        offset += 4 * sequences
        self.sequence_pointers = raw[offset:offset + 8 * sequences].view("<i8")
        offset += 8 * sequences
        self.document_indices = raw[offset:offset + 8 * doc_entries].view("<i8")
        docs = self.document_indices
        if doc_entries < 1 or docs[0] != 0 or docs[-1] != sequences or np.any(np.diff(docs) < 0):
            raise ValueError(f"{idx_file} has an inconsistent document index "
                             f"(it must rise from 0 to the sequence count {sequences})")

    def _check_data_size(self, bin_file: Path) -> None:
        expected = int(self.sequence_lengths.astype(np.int64).sum()) * self.dtype.itemsize
        actual = bin_file.stat().st_size
        if actual < expected:
            raise ValueError(f"{bin_file} is truncated: {actual} bytes, its index "
                             f"{index_path(self.prefix).name} needs {expected}; rebuild both files")
        if actual > expected:
            raise ValueError(f"{bin_file} has {actual} bytes, its index expects {expected}: the "
                             f".bin and .idx do not belong together; rebuild both files")

    def _map_tokens(self) -> np.ndarray:
        if self.num_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self._bin_path, dtype=self.dtype, mode="r")

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.astype(np.int64).sum())

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``index`` (a read-only view)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {index} "
                             f"of {size} tokens")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def check_vocab(self, vocab_size: int, scan_tokens: int = 2**26) -> None:
        """Raise ``ValueError`` unless a tokenizer of ``vocab_size`` ids fits this data's dtype and the first
        ``scan_tokens`` tokens are ids in ``[0, vocab_size)`` (a bounded scan, about 0.1 s: data made with
        another tokenizer shows it from the start)."""
        check_vocab_fits(self.dtype, vocab_size, what=f"{data_path(self.prefix)}")
        head = self._tokens[:scan_tokens]
        low, high = (int(head.min()), int(head.max())) if head.size else (0, 0)
        if high >= vocab_size or low < 0:
            bad = high if high >= vocab_size else low
            raise ValueError(f"{data_path(self.prefix)} holds token id {bad}, outside the model's {vocab_size} ids: it "
                             f"was tokenized with another tokenizer; train with the tokenizer it was made with "
                             f"(data.tokenizer), or re-run cp-train-preprocess with this one")
