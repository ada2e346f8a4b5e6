"""cp-train-preprocess on a small temporary corpus of text and JSON-lines files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cp_train.cli.preprocess import run
from cp_train.data.indexed import IndexedDataset, data_path, index_path
from cp_train.data.preprocess import PreprocessError, list_input_files
from cp_train.data.tokenizers.spm import Tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Tokenizer, list[str], list[Path]]:
    """(tokenizer model, tokenizer, expected documents in order, inputs)."""
    root = tmp_path_factory.mktemp("corpus")
    model = train_tokenizer([Path(textwrap.__file__)], 400, root / "tok")
    texts = root / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "b.txt").write_text("second file\n\tindented\n")
    (texts / "a.txt").write_text("first file: déjà vu\n")
    (texts / "sub" / "c.txt").write_text("nested   spaces\n")
    (texts / "empty.txt").write_text("")
    (texts / ".hidden.txt").write_text("never read\n")
    lines = root / "lines.jsonl"
    records = [{"text": "json one\n", "id": 1}, {"text": "json two", "id": 2}, {"text": "", "id": 3}]
    lines.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    expected = ["first file: déjà vu\n", "second file\n\tindented\n", "nested   spaces\n",
                "json one\n", "json two"]
    return model, Tokenizer(model), expected, [texts, lines]


def _run(tokenizer_model: Path, inputs: list[Path], prefix: Path, *extra: str):
    return run(["--input", *map(str, inputs), "--tokenizer", str(tokenizer_model),
                 "--output-prefix", str(prefix), "--quiet", *extra])


def test_directories_are_expanded_sorted_without_hidden(corpus):
    texts = corpus[3][0]
    names = [p.relative_to(texts).as_posix() for p in list_input_files([texts], "*.txt")]
    assert names == ["a.txt", "b.txt", "empty.txt", "sub/c.txt"]


def test_documents_round_trip_with_eod(tmp_path, corpus, capsys):
    model, tokenizer, expected, inputs = corpus
    summary = _run(model, inputs, tmp_path / "out" / "data")
    ds = IndexedDataset(tmp_path / "out" / "data")
    assert ds.dtype == np.uint16
    assert summary.documents == len(ds) == ds.num_documents == len(expected)
    assert summary.skipped_empty == 2
    assert summary.tokens == ds.num_tokens
    for i, text in enumerate(expected):
        tokens = ds[i]
        assert tokens[-1] == tokenizer.eod
        assert tokenizer.eod not in tokens[:-1]
        assert tokenizer.decode(tokens[:-1]) == text
    printed = capsys.readouterr().out
    assert "5 documents" in printed and "tokens/s" in printed


def test_workers_give_identical_files(tmp_path, corpus):
    model, _, _, inputs = corpus
    _run(model, inputs, tmp_path / "one")
    _run(model, inputs, tmp_path / "two", "--workers", "2")
    for path in (data_path, index_path):
        assert path(tmp_path / "one").read_bytes() == path(tmp_path / "two").read_bytes()


def test_json_key_selects_the_field(tmp_path, corpus):
    model, tokenizer, _, _ = corpus
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"body": "custom key\n"}) + "\n")
    _run(model, [records], tmp_path / "k", "--json-key", "body")
    assert tokenizer.decode(IndexedDataset(tmp_path / "k")[0][:-1]) == "custom key\n"
    with pytest.raises(ValueError, match=r"r\.jsonl:1 has no 'text' field; pass the right --json-key"):
        _run(model, [records], tmp_path / "k2")


def test_bad_inputs(tmp_path, corpus):
    model = corpus[0]
    with pytest.raises(PreprocessError, match=r"missing\.txt does not exist"):
        _run(model, [tmp_path / "missing.txt"], tmp_path / "x")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2 is not valid JSON"):
        _run(model, [broken], tmp_path / "x")
    with pytest.raises(PreprocessError, match=r"--tokenizer: .*none\.model is missing"):
        _run(tmp_path / "none.model", [broken], tmp_path / "x")


def test_command_line(tmp_path, corpus):
    model, _, expected, inputs = corpus
    prefix = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "cp_train.cli.preprocess", "--input", *map(str, inputs), "--tokenizer",
         str(model), "--output-prefix", str(prefix), "--workers", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(expected)} documents" in result.stdout
    assert len(IndexedDataset(prefix)) == len(expected)


def _command(tokenizer_model: Path, inputs: list[Path], prefix: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cp_train.cli.preprocess", "--input", *map(str, inputs), "--tokenizer",
                           str(tokenizer_model), "--output-prefix", str(prefix), "--quiet", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_command_line_errors_are_one_line_naming_the_file(tmp_path, corpus):
    """Each bad input through ``python -m cp_train.cli.preprocess`` (``cp-train-preprocess``): exit code 2, one
    line naming the file (and line), no traceback, and no output files left behind (an earlier good output
    stays as it was)."""
    model = corpus[0]
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    cases = {  # name -> (file contents, expected message)
        "missing.jsonl": (None, r"--input \S*missing\.jsonl does not exist"),
        "broken.jsonl": (b'{"text": "ok"}\n{not json\n', r"broken\.jsonl:2 is not valid JSON \(.*column 2\)"),
        "nokey.jsonl": (b'{"text": "ok"}\n\n{"body": "x"}\n', r"nokey\.jsonl:3 has no 'text' field; pass the right "
                                                              r"--json-key"),
        "latin1.jsonl": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"latin1\.jsonl:2: not UTF-8 \(byte 0xe9 at "
                                                                    r"column 14\); convert the file to UTF-8"),
    }
    prefix = tmp_path / "out" / "data"
    assert _command(model, [good], prefix).returncode == 0
    before = (data_path(prefix).read_bytes(), index_path(prefix).read_bytes())
    for name, (contents, message) in cases.items():
        if contents is not None:
            (tmp_path / name).write_bytes(contents)
        done = _command(model, [good, tmp_path / name], prefix, "--workers", "2" if name == "broken.jsonl" else "1")
        output = done.stdout + done.stderr
        assert done.returncode == 2, (name, output)
        lines = [line for line in output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("cp-train-preprocess: error: "), (name, output)
        assert re.search(message, lines[0]), (name, lines[0])
        assert "Traceback" not in output
        assert (data_path(prefix).read_bytes(), index_path(prefix).read_bytes()) == before, name
        assert sorted(p.name for p in prefix.parent.iterdir()) == ["data.bin", "data.idx"], name


def test_command_line_warns_about_empty_inputs(tmp_path, corpus):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = _command(corpus[0], [empty], tmp_path / "e")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"cp-train-preprocess: warning: {empty} is empty: it adds no document",
        f"cp-train-preprocess: warning: the inputs hold no document: {tmp_path / 'e.bin'} is an empty dataset"]
    assert len(IndexedDataset(tmp_path / "e")) == 0
