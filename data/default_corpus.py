"""The default corpus: the installed Python standard library's sources, tokenized.

    python -m cp_train.cli.prepare_corpus [--cache-dir DIR] [--workers N]

Needs no network: it reads the ``.py`` files of the running Python's standard library (sorted,
without test directories and site-packages), trains a SentencePiece BPE tokenizer (8192 ids) on
their lines and writes one document per file into a Megatron ``.bin``/``.idx`` pair:

    DIR/stdlib-py3XX-v1-vocab8192/{tokenizer.model, corpus.bin, corpus.idx, manifest.json}

``DIR`` is ``--cache-dir``, else ``$CP_TRAIN_CACHE``, else ``~/.cache/cp-train``. The build is
deterministic (same machine, same bytes) and idempotent: when ``manifest.json`` exists the
files are returned as they are. It is built in a temporary directory and renamed into place,
so concurrent callers (e.g. several ranks) never see a half-written corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

from cp_train.data.indexed import partial_name
from cp_train.data.preprocess import iter_documents, preprocess
from cp_train.data.tokenizers.spm import train_tokenizer

CORPUS_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192
TRAINER_THREADS = 4  # fixed: SentencePiece stores it in the model, so it must not vary by machine
SKIPPED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                                 "__pycache__", "lib-dynload"})


class DefaultCorpus(NamedTuple):
    tokenizer_model: Path
    data_prefix: Path


def default_cache_dir() -> Path:
    """``$CP_TRAIN_CACHE`` if set, else ``~/.cache/cp-train``."""
    override = os.environ.get("CP_TRAIN_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "cp-train"


def stdlib_sources(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's ``.py`` files in sorted order, test and package dirs skipped."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirectories, files in os.walk(base):
        subdirectories[:] = sorted(d for d in subdirectories
                                   if d not in SKIPPED_DIRECTORIES and not d.startswith("."))
        found.extend(Path(directory) / name for name in sorted(files)
                     if name.endswith(".py") and not name.startswith("test_"))
    return found


def corpus_dir(cache_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir / f"stdlib-{version}-v{CORPUS_VERSION}-vocab{vocab_size}"


def _paths(directory: Path) -> DefaultCorpus:
    return DefaultCorpus(directory / "tokenizer.model", directory / "corpus")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(directory: Path, sources: list[Path], vocab_size: int, workers: int,
           progress: bool) -> dict:
    start = time.perf_counter()
    paths = _paths(directory)
    train_tokenizer(sources, vocab_size, directory / "tokenizer", num_threads=TRAINER_THREADS)
    trained = time.perf_counter()
    summary = preprocess(iter_documents(sources), paths.tokenizer_model, paths.data_prefix,
                         workers=workers, progress=progress, total=len(sources))
    return {
        "source_root": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
        "files": len(sources), "documents": summary.documents, "tokens": summary.tokens,
        "vocab_size": vocab_size, "tokenizer_seconds": round(trained - start, 2),
        "preprocess_seconds": round(summary.seconds, 2),
        "sha256": {name: _sha256(directory / name)
                   for name in ("tokenizer.model", "corpus.bin", "corpus.idx")},
    }


def prepare_default_corpus(cache_dir: str | os.PathLike | None = None, *,
                           vocab_size: int = DEFAULT_VOCAB_SIZE, workers: int | None = None,
                           progress: bool = False) -> DefaultCorpus:
    """Build the default corpus if it is missing; return (tokenizer model path, data prefix)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = corpus_dir(cache, vocab_size)
    if (final / "manifest.json").is_file():
        return _paths(final)
    sources = stdlib_sources()
    if not sources:
        raise FileNotFoundError(f"no standard library sources found under "
                                f"{sysconfig.get_paths()['stdlib']}; point CP_TRAIN_CACHE at a "
                                f"directory holding a prepared corpus instead")
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    cache.mkdir(parents=True, exist_ok=True)
    partial = partial_name(cache / final.name)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        manifest = _build(partial, sources, vocab_size, workers, progress)
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists() and not (final / "manifest.json").is_file():
            shutil.rmtree(final)  # left over from an interrupted build of an older version
        try:
            os.rename(partial, final)
        except OSError:
            if not (final / "manifest.json").is_file():  # someone else won the race otherwise
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return _paths(final)
