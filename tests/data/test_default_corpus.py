"""The embedded default corpus: builds in under two minutes, round-trips, idempotent."""

from __future__ import annotations

import hashlib
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from cp_train.cli.prepare_corpus import run as prepare_corpus
from cp_train.data.default_corpus import (
    DEFAULT_VOCAB_SIZE,
    corpus_dir,
    default_cache_dir,
    prepare_default_corpus,
    stdlib_sources,
)
from cp_train.data.gpt_dataset import GPTDataset
from cp_train.data.indexed import IndexedDataset, data_path, index_path
from cp_train.data.tokenizers.spm import Tokenizer

BUILD_LIMIT_S = 120.0


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, float]:
    cache = tmp_path_factory.mktemp("cp-train-cache")
    start = time.perf_counter()
    prepare_default_corpus(cache)
    return cache, time.perf_counter() - start


def test_stdlib_sources_are_sorted_and_skip_tests():
    sources = stdlib_sources()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(sources) > 300
    relative = [p.relative_to(root) for p in sources]
    assert all(p.suffix == ".py" for p in relative)
    assert not [p for p in relative if {"test", "tests", "idle_test", "site-packages"} & set(p.parts)]
    assert Path("json/decoder.py") in relative and Path("textwrap.py") in relative
    assert stdlib_sources() == sources


def test_cache_dir_defaults_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("CP_TRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "cp-train"
    monkeypatch.setenv("CP_TRAIN_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"


@pytest.mark.slow
def test_builds_in_under_two_minutes(built):
    cache, seconds = built
    assert seconds < BUILD_LIMIT_S, f"default corpus took {seconds:.1f} s"
    directory = corpus_dir(cache)
    manifest = json.loads((directory / "manifest.json").read_text())
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary leftovers


@pytest.mark.slow
def test_tokenizer_round_trips_and_data_loads(built):
    tokenizer_model, prefix = prepare_default_corpus(built[0])
    tokenizer = Tokenizer(tokenizer_model)
    assert tokenizer.vocab_size == DEFAULT_VOCAB_SIZE
    source = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    for text in (source, "def f(x):\n\treturn x  # café 中\n", "    \n\n"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(source)) < len(source) / 2.5  # a real vocabulary, not bytes

    indexed = IndexedDataset(prefix)
    indexed.check_vocab(tokenizer.vocab_size)
    assert indexed.dtype == np.uint16
    assert 0.9 * len(stdlib_sources()) < len(indexed) <= len(stdlib_sources())
    assert indexed.num_tokens > 1_000_000
    ends = indexed.sequence_pointers // 2 + indexed.sequence_lengths - 1
    assert np.all(np.memmap(data_path(prefix), np.uint16, "r")[ends] == tokenizer.eod)
    first_doc = tokenizer.decode(indexed[0][:-1])
    assert first_doc == stdlib_sources()[0].read_text(encoding="utf-8", errors="replace")

    dataset = GPTDataset(indexed, 512, 8, seed=1, cache_dir=built[0] / "samples")
    assert dataset[0]["tokens"].shape == (512,)


@pytest.mark.slow
def test_second_call_returns_existing_files(built, capsys):
    cache = built[0]
    corpus = prepare_default_corpus(cache)
    files = [corpus.tokenizer_model, data_path(corpus.data_prefix), index_path(corpus.data_prefix)]
    stamps = [p.stat().st_mtime_ns for p in files]
    start = time.perf_counter()
    assert prepare_corpus(["--cache-dir", str(cache)]) == corpus
    assert time.perf_counter() - start < 10.0  # no tokenizer training, no tokenizing (a loaded machine: seconds)
    assert [p.stat().st_mtime_ns for p in files] == stamps
    out = capsys.readouterr().out
    assert str(corpus.tokenizer_model) in out and "documents" in out
