"""Hugging Face ``tokenizer.json`` tokenizers (the ``tokenizers`` library), beside SentencePiece.

``HFTokenizer(path)`` takes a ``tokenizer.json`` file or a model directory holding one. ``encode``
returns exactly the ids of ``tokenizers.Tokenizer.from_file(...).encode(text).ids`` (the
tokenizer's own post-processor decides on special tokens such as Llama 3's begin-of-text).
EOD (appended after every document by ``cp-train-preprocess``) is the tokenizer's eos: the
``eos_token`` of ``tokenizer_config.json`` beside it, else the ``eos_token_id`` of ``config.json``
or ``generation_config.json`` there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tokenizer

from cp_train.data.tokenizers.vocab import padded_vocab_size

TOKENIZER_FILE = "tokenizer.json"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer with the interface of ``data.tokenizer.Tokenizer``."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.model_path = path / TOKENIZER_FILE if path.is_dir() else path
        if not self.model_path.is_file():
            raise FileNotFoundError(f"tokenizer {self.model_path} is missing: pass a tokenizer.json file or a "
                                    f"Hugging Face model directory that holds one")
        try:
            self._tok = _Tokenizer.from_file(str(self.model_path))
        except Exception as error:  # noqa: BLE001 - the library raises a bare Exception for bad files
            raise ValueError(f"{self.model_path} is not a tokenizers tokenizer.json: {error}") from None
        self._config = _read_json(self.model_path.parent / "tokenizer_config.json")
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        self.eos = self._eos_id()

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def _special(self, name: str) -> int | None:
        text = _token_text(self._config.get(name))
        if text is None:
            return None
        token = self._tok.token_to_id(text)
        if token is None:
            raise ValueError(f"{self.model_path.parent / 'tokenizer_config.json'}: {name} {text!r} is not a token "
                             f"of {self.model_path}")
        return token

    def _eos_id(self) -> int:
        eos = self._special("eos_token")
        for name in ("config.json", "generation_config.json"):
            if eos is None:
                eos = _first_id(_read_json(self.model_path.parent / name).get("eos_token_id"))
        if eos is None:
            raise ValueError(f"cannot tell the end-of-document (eos) token of {self.model_path}: put a "
                             f"tokenizer_config.json with eos_token (or a config.json with eos_token_id) beside it")
        return eos

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document (= eos)."""
        return self.eos

    @property
    def bos(self) -> int | None:
        return self._special("bos_token")

    @property
    def pad(self) -> int | None:
        """Padding id, or None when the tokenizer config names none."""
        return self._special("pad_token")

    def padded_vocab_size(self, tp: int = 1, multiple: int = 128) -> int:
        """Embedding rows: ``vocab_size`` (largest id + 1) rounded up to a multiple of ``multiple * tp``."""
        return padded_vocab_size(self.vocab_size, tp, multiple)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens added as the tokenizer's post-processor says (no EOD)."""
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"


def train_hf_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> Path:
    """Train a byte-level BPE ``tokenizer.json`` (Llama 3 style: bos added before every text, eos = EOD) on
    ``texts``; writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` and returns the former.
    Ids 0 and 1 are bos and eos."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = _Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A",
                                                             special_tokens=[(BOS_TOKEN, 0)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
              "model_max_length": 1 << 30}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out / TOKENIZER_FILE
