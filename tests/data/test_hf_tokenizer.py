"""Hugging Face tokenizer.json through the ``tokenizers`` library: the same ids as the library, EOD = eos after
every document in cp-train-preprocess, the trainer's tokenizer resolution, and clear errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as LibraryTokenizer

from cp_train import build
from cp_train.cli.preprocess import main as preprocess_main
from cp_train.config.sources import build_config
from cp_train.data.indexed import IndexedDataset
from cp_train.data.tokenizers.hf import BOS_TOKEN, EOS_TOKEN, HFTokenizer, train_hf_tokenizer
from cp_train.data.tokenizers.load import load_tokenizer
from cp_train.data.tokenizers.spm import Tokenizer

DOCUMENTS = ["def f(x):\n    return x * 2\n", "déjà vu — naïve café\n", "class A:\n    pass\n\n\n# end"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-tok")
    train_hf_tokenizer([Path(textwrap.__file__).read_text(), *DOCUMENTS], 700, root)
    return root


def test_ids_equal_the_tokenizers_library(tokenizer_dir) -> None:
    library = LibraryTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for path in (tokenizer_dir, tokenizer_dir / "tokenizer.json"):
        tokenizer = load_tokenizer(path)
        assert isinstance(tokenizer, HFTokenizer)
        for text in DOCUMENTS:
            ids = tokenizer.encode(text)
            assert ids == library.encode(text).ids and ids[0] == tokenizer.bos == library.token_to_id(BOS_TOKEN)
            assert tokenizer.decode(ids) == BOS_TOKEN + text
    tokenizer = HFTokenizer(tokenizer_dir)
    assert tokenizer.eod == tokenizer.eos == library.token_to_id(EOS_TOKEN)
    assert tokenizer.vocab_size == 700 and tokenizer.padded_vocab_size() == 768 and tokenizer.pad is None


def test_preprocess_appends_eod_per_document(tokenizer_dir, tmp_path) -> None:
    inputs = tmp_path / "docs.jsonl"
    inputs.write_text("\n".join(json.dumps({"text": t}) for t in DOCUMENTS) + "\n")
    library = LibraryTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = library.token_to_id(EOS_TOKEN)
    for workers in (1, 2):
        prefix = tmp_path / f"out{workers}"
        preprocess_main(["--input", str(inputs), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(prefix),
                         "--quiet", "--workers", str(workers)])
        data = IndexedDataset(prefix)
        assert data.dtype == np.uint16 and len(data) == len(DOCUMENTS)
        for i, text in enumerate(DOCUMENTS):
            assert data[i].tolist() == library.encode(text).ids + [eos], (workers, i)


def test_trainer_resolves_a_tokenizer_directory(tokenizer_dir, tmp_path) -> None:
    config = build_config([("test", {"data.prefix": str(tmp_path / "data"), "data.tokenizer": str(tokenizer_dir)})])
    sources = build.resolve_data(config, None)  # a given prefix needs no parallel state
    assert (sources.eod_id, sources.vocab_size, sources.pad_id) == (1, 768, None)
    assert config.model.vocab_size == 768
    small = build_config([("test", {"data.prefix": "x", "data.tokenizer": str(tokenizer_dir),
                                    "model.vocab_size": 512})])
    with pytest.raises(ValueError, match=r"model.vocab_size 512 is smaller than the 700 ids of the tokenizer"):
        build.resolve_data(small, None)


def test_sentencepiece_models_still_load_and_bad_files_are_named(tokenizer_dir, tmp_path) -> None:
    from cp_train.data.tokenizers.spm import train_tokenizer

    model = train_tokenizer([Path(textwrap.__file__)], 400, tmp_path / "sp")
    assert type(load_tokenizer(model)) is Tokenizer
    with pytest.raises(FileNotFoundError, match="tokenizer .*nowhere is missing: pass a SentencePiece .model"):
        load_tokenizer(tmp_path / "nowhere")
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer .*bare/tokenizer.json is missing: pass a tokenizer.json"):
        load_tokenizer(bare)
    (bare / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="cannot tell the end-of-document \\(eos\\) token of .*tokenizer.json: put "
                                         "a tokenizer_config.json with eos_token"):
        HFTokenizer(bare)
    (bare / "config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert HFTokenizer(bare).eod == 5  # falls back to the model config's (first) eos_token_id
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|nope|>"}}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>' is not a token of"):
        HFTokenizer(bare)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="junk.json is not a tokenizers tokenizer.json"):
        HFTokenizer(tmp_path / "junk.json")
