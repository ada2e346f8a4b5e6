"""A tiny random Hugging Face Llama with a BPE ``tokenizer.json``, for CPU demos of the HF recipes (no downloads).

    python -m cp_train.cli.tiny_hf OUT_DIR [--context 128] [--vocab-size 2048] [--seed 0]

Trains a byte-level BPE tokenizer (Llama 3 style: ``<|begin_of_text|>`` before every document,
``<|end_of_text|>`` = EOD) on the installed Python standard library's sources, draws a small
Llama-shaped model (4 layers, hidden 128, 4 heads, 2 kv heads, tied embeddings, RoPE theta
10000, context ``--context``) from ``--seed`` and writes both as an HF model directory that
``load_llama``, ``--init-from-hf`` and ``transformers`` read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cp_train.data.default_corpus import stdlib_sources
from cp_train.data.tokenizers.hf import HFTokenizer, train_hf_tokenizer
from cp_train.errors import InputError, ensure_writable_dir, run_entry_point
from cp_train.model.config import ModelConfig
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import save_llama

TOKENIZER_FILES = 400  # stdlib sources the tokenizer is trained on (the first, sorted)


def tiny_model_config(vocab_size: int, context: int, seed: int = 0) -> ModelConfig:
    """The demo model's shape (about 1 M parameters besides the embedding)."""
    return ModelConfig(vocab_size=vocab_size, num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=384, max_position_embeddings=context, norm_eps=1e-6, tie_embeddings=True,
                       seed=seed)


def make_tiny_hf(out_dir: str | Path, context: int = 128, vocab_size: int = 2048, seed: int = 0) -> Path:
    """Write the tokenizer and the random model into ``out_dir``; returns it."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        raise InputError(f"{out} already holds a model (config.json): pass a new directory, or remove it first")
    ensure_writable_dir(out, "the output directory")
    texts = (path.read_text(encoding="utf-8", errors="replace") for path in stdlib_sources()[:TOKENIZER_FILES])
    train_hf_tokenizer(texts, vocab_size, out)
    tokenizer = HFTokenizer(out)
    model = GPTModel(tiny_model_config(tokenizer.vocab_size, context, seed))
    save_llama(model, out, extra_config={"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eos})
    (out / "README.txt").write_text(f"Random tiny Llama (seed {seed}, context {context}) made by "
                                    f"python -m cp_train.cli.tiny_hf for CPU demos; it has never been trained.\n")
    return out


def run(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m cp_train.cli.tiny_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory")
    parser.add_argument("--context", type=int, default=128, help="max_position_embeddings (default 128)")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    out = make_tiny_hf(args.out, args.context, args.vocab_size, args.seed)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: vocab {config['vocab_size']}, {config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, context {config['max_position_embeddings']}, tokenizer.json")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point("python -m cp_train.cli.tiny_hf", lambda args: run(args) and None, argv)


if __name__ == "__main__":
    sys.exit(main())
