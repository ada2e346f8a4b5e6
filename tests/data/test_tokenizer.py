"""SentencePiece wrapper and trainer: exact round trips, special ids, padding, determinism."""

from __future__ import annotations

import json.decoder
import pickle
import textwrap
from pathlib import Path

import pytest

from cp_train.data.tokenizers.load import padded_vocab_size
from cp_train.data.tokenizers.spm import Tokenizer, train_tokenizer

SOURCES = [Path(textwrap.__file__), Path(json.decoder.__file__)]
TRICKY = [
    "def f(x):\n\treturn  x  # two spaces\n",
    "    indented\n\n\n  trailing   \n",
    " leading space",
    "unicode: é, 中文, emoji 🙂, nul-free\r\n",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tok") / "small"
    return Tokenizer(train_tokenizer(SOURCES, 500, prefix))


def test_round_trip_is_exact(tokenizer):
    for text in TRICKY + [SOURCES[0].read_text()]:
        ids = tokenizer.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text


def test_decode_takes_any_int_sequence(tokenizer):
    import numpy as np
    import torch

    ids = tokenizer.encode("import os\n")
    assert tokenizer.decode(np.asarray(ids, dtype=np.uint16)) == "import os\n"
    assert tokenizer.decode(torch.tensor(ids)) == "import os\n"


def test_special_ids(tokenizer):
    assert tokenizer.vocab_size == 500
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.pad) == (0, 1, 2, 3)
    assert tokenizer.eod == tokenizer.eos
    ids = tokenizer.encode("x = 1\n" * 20)
    assert not {tokenizer.bos, tokenizer.eos, tokenizer.pad} & set(ids)
    assert tokenizer.decode(ids + [tokenizer.eod]) == "x = 1\n" * 20  # EOD decodes to nothing


def test_padded_vocab_size():
    assert padded_vocab_size(500) == 512
    assert padded_vocab_size(512) == 512
    assert padded_vocab_size(513) == 640
    assert padded_vocab_size(8192, tp=3) == 8448  # multiple of 384
    assert padded_vocab_size(50257, tp=2, multiple=64) == 50304
    with pytest.raises(ValueError):
        padded_vocab_size(100, tp=0)


def test_tokenizer_method_pads(tokenizer):
    assert tokenizer.padded_vocab_size() == 512
    assert tokenizer.padded_vocab_size(tp=4) == 512
    assert tokenizer.padded_vocab_size(tp=8) == 1024


def test_training_is_deterministic(tmp_path, tokenizer):
    again = train_tokenizer(SOURCES, 500, tmp_path / "elsewhere" / "other_name")
    assert again.name == "other_name.model"
    assert again.read_bytes() == tokenizer.model_path.read_bytes()


def test_sentence_cap_subsamples_lines(tmp_path, tokenizer):
    capped = Tokenizer(train_tokenizer(SOURCES, 400, tmp_path / "capped", max_sentences=100))
    assert capped.vocab_size == 400
    assert capped.model_path.read_bytes() != tokenizer.model_path.read_bytes()
    assert capped.decode(capped.encode(TRICKY[0])) == TRICKY[0]


def test_pickles_for_worker_processes(tokenizer):
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode(TRICKY[1]) == tokenizer.encode(TRICKY[1])


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.model is missing"):
        Tokenizer(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match=r"absent\.txt is missing"):
        train_tokenizer([tmp_path / "absent.txt"], 500, tmp_path / "x")
    with pytest.raises(ValueError, match="at least 300"):
        train_tokenizer(SOURCES, 100, tmp_path / "x")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer([blank], 500, tmp_path / "x")
