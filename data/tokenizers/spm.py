"""SentencePiece tokenizer: a thin wrapper for the trainer and a deterministic trainer for models.

``load.load_tokenizer(path)`` opens either kind: SentencePiece ``.model`` files (here) or Hugging Face
``tokenizer.json`` files and their directories (``hf.py``).

Models made by ``train_tokenizer`` keep text byte-exact (identity normalization, whitespace kept,
byte fallback for characters outside the vocab), so ``decode(encode(text)) == text`` for any
Python source. Special ids: unk 0, bos 1, eos 2 (= eod, appended after every document), pad 3.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from cp_train.data.indexed import partial_name
from cp_train.data.tokenizers.vocab import padded_vocab_size

PathLike = str | os.PathLike

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


class Tokenizer:
    """A trained SentencePiece model. ``encode(str) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(self, model_path: PathLike) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {self.model_path} is missing; train one with train_tokenizer or "
                f"build the default one with python -m cp_train.cli.prepare_corpus")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except RuntimeError as error:  # sentencepiece's "could not parse ModelProto"
            raise ValueError(f"{self.model_path} is not a SentencePiece model ({error}): pass a .model file "
                             f"trained by sentencepiece, or a Hugging Face tokenizer.json") from None

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    @property
    def vocab_size(self) -> int:
        """Number of ids the model produces (before padding for the embedding)."""
        return self._sp.get_piece_size()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document (= eos)."""
        return self._sp.eos_id()

    @property
    def pad(self) -> int | None:
        """Padding id, or None when the model has no pad piece."""
        pad = self._sp.pad_id()
        return None if pad < 0 else pad

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def padded_vocab_size(self, tp: int = 1, multiple: int = 128) -> int:
        """Embedding rows: ``vocab_size`` rounded up to a multiple of ``multiple * tp``."""
        return padded_vocab_size(self.vocab_size, tp, multiple)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (any iterable of ints: list, numpy array, 1-D tensor)."""
        return self._sp.decode([int(i) for i in ids])


def _lines(paths: Sequence[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                line = line.rstrip("\n")
                if line.strip():
                    yield line


def _every_kth(lines: Iterator[str], keep_every: int) -> Iterator[str]:
    for i, line in enumerate(lines):
        if i % keep_every == 0:
            yield line


def train_tokenizer(inputs: Sequence[PathLike], vocab_size: int, model_prefix: PathLike, *,
                    model_type: str = "bpe", max_sentences: int = 2_000_000,
                    num_threads: int = 4, character_coverage: float = 0.9995) -> Path:
    """Train a SentencePiece model on the lines of the text files ``inputs``; return its path.

    Writes ``{model_prefix}.model``. Blank lines are skipped; when there are more than
    ``max_sentences`` lines, every k-th line is used (a deterministic subsample), so the same
    inputs and ``num_threads`` (recorded in the model) always give the same model bytes.
    ``vocab_size`` must leave room for the 256 byte pieces and the 4 special pieces.
    """
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer training input {path} is missing")
    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte fallback alone needs 260 "
                         f"pieces; use at least 300")
    line_count = sum(1 for _ in _lines(paths))
    if line_count == 0:
        raise ValueError(f"no text to train a tokenizer on in {', '.join(map(str, paths))}")
    keep_every = max(1, math.ceil(line_count / max_sentences))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_every_kth(_lines(paths), keep_every), model_writer=model,
        vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, byte_fallback=True,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=16384,
        num_threads=num_threads, minloglevel=2)
    out = Path(f"{os.fspath(model_prefix)}.model")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_name(out)
    partial.write_bytes(model.getvalue())
    os.replace(partial, out)
    return out
