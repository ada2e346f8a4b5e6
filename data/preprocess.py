"""Tokenize text into a Megatron ``.bin``/``.idx`` pair (the command is ``cp-train-preprocess``).

Inputs: text files (one document per file, read as UTF-8 with undecodable bytes replaced),
``.jsonl``/``.json`` files (one JSON object per line in UTF-8, the document is ``obj[json_key]``) and
directories (searched recursively for ``--glob``, sorted). ``--tokenizer`` is a SentencePiece ``.model``
or a Hugging Face ``tokenizer.json`` (or its directory; EOD = its eos). Every document gets the
tokenizer's EOD id appended; empty documents are skipped. Writes ``PREFIX.bin`` and ``PREFIX.idx``,
uint16 when the vocab fits, else int32, under temporary names renamed at the end (a failed run leaves
no ``.bin`` without its ``.idx``).

A bad input (a missing file, a JSON line that does not parse or lacks the key, bytes that are not
UTF-8) raises ``PreprocessError`` naming the file and line (the command reports it in one line, exit
code 2).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cp_train.data.indexed import IndexedDatasetWriter, data_path, index_path, token_dtype_for_vocab
from cp_train.data.tokenizers.load import load_tokenizer
from cp_train.data.tokenizers.spm import Tokenizer

PathLike = str | os.PathLike
class PreprocessError(ValueError):
    """A bad input file or tokenizer; the message says which and what to change (the command reports it in one
    line)."""


JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class PreprocessSummary:
    documents: int
    tokens: int
    skipped_empty: int
    seconds: float
    prefix: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return (f"wrote {data_path(self.prefix)} and {index_path(self.prefix)}: "
                f"{self.documents} documents, {self.tokens} tokens "
                f"({self.skipped_empty} empty skipped) in {self.seconds:.1f} s, "
                f"{self.tokens_per_second:,.0f} tokens/s")


def list_input_files(inputs: Sequence[PathLike], glob: str = "*") -> list[Path]:
    """Expand directories (recursively, sorted, hidden entries skipped); keep files as given."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob(glob)
                           if p.is_file() and not any(part.startswith(".")
                                                      for part in p.relative_to(item).parts))
            files.extend(found)
        elif item.is_file():
            files.append(item)
        else:
            raise PreprocessError(f"--input {item} does not exist: pass existing files or directories")
    return files


def _json_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines of ``path``; PreprocessError at the first line that is not UTF-8."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PreprocessError(f"{path}:{number}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                                 f"{err.start + 1}); convert the file to UTF-8") from None
            if line.strip():
                yield number, line


def iter_documents(files: Iterable[Path], json_key: str = "text") -> Iterator[str]:
    """Documents in order: a whole text file, or ``obj[json_key]`` per line of a JSON-lines file."""
    for path in files:
        if path.suffix not in JSON_SUFFIXES:
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        for number, line in _json_lines(path):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PreprocessError(f"{path}:{number} is not valid JSON ({err.msg} at column {err.colno}); "
                                 f"each line must be one JSON object") from None
            if not isinstance(record, dict) or json_key not in record:
                raise PreprocessError(f"{path}:{number} has no {json_key!r} field; pass the right --json-key")
            yield str(record[json_key])


_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(model_path)


def _encode(text: str) -> list[int]:
    assert _worker_tokenizer is not None, "worker not initialised"
    return _worker_tokenizer.encode(text)


def preprocess(documents: Iterable[str], tokenizer_model: PathLike, output_prefix: PathLike,
               workers: int = 1, progress: bool = True, total: int | None = None) -> PreprocessSummary:
    """Tokenize ``documents`` (in order, EOD appended) into ``output_prefix``.bin/.idx.

    ``workers > 1`` tokenizes in that many processes; the output is identical either way.
    """
    try:
        tokenizer = load_tokenizer(tokenizer_model)
    except FileNotFoundError as error:
        raise PreprocessError(f"--tokenizer: {error}") from None
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    count = tokens = skipped = 0
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(str(tokenizer.model_path),))
        encoded: Iterable[list[int]] = pool.imap(_encode, documents, chunksize=8)
    else:
        encoded = map(tokenizer.encode, documents)
    try:
        with IndexedDatasetWriter(output_prefix, dtype) as writer:
            for ids in tqdm(encoded, total=total, unit="doc", disable=not progress,
                            desc="tokenizing"):
                if not ids:
                    skipped += 1
                    continue
                ids.append(tokenizer.eod)
                writer.add_document(np.asarray(ids, dtype=dtype))
                count += 1
                tokens += len(ids)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return PreprocessSummary(count, tokens, skipped, time.perf_counter() - start,
                             os.fspath(output_prefix))
