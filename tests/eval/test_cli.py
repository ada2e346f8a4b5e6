"""``cp-train-eval`` end to end on a tiny HF directory (a word-level ``tokenizer.json``, a random 1-layer
Llama, a small indexed dataset): JSON records with exactly the issue's keys, the table, the PNGs; and bad input
as one line each (an unknown task, a length above the model's positions, a filler that does not fit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cp_train.data.indexed import IndexedDatasetWriter
from cp_train.errors import InputError
from cp_train.eval import prompts
from cp_train.eval.cli import main
from cp_train.eval.report import table
from cp_train.model.config import ModelConfig
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import save_llama

REPO = Path(__file__).resolve().parents[2]
GRID_KEYS = ["task", "length", "depth", "trials", "accuracy", "key_logprob"]
LOSS_KEYS = ["task", "bucket_start", "bucket_end", "nll", "cum_nll", "tokens"]


def _word_tokenizer(out: Path) -> dict[str, int]:
    """A word-level tokenizer.json over the prompts' words and single digits, EOS ``<eos>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    texts = [prompts.TASK_LINE, *prompts.FILLER, prompts.PASSKEY_LINE, prompts.PASSKEY_QUESTION, prompts.NEEDLE,
             prompts.NEEDLE_QUESTION, "def class return import self"]
    split = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    words = sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)} | set("0123456789"))
    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = split
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return vocab


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval_cli")
    hf = root / "hf"
    hf.mkdir()
    vocab = _word_tokenizer(hf)
    config = ModelConfig(vocab_size=128, num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, max_position_embeddings=128, seed=3)
    assert len(vocab) <= config.vocab_size
    save_llama(GPTModel(config), hf)
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(root / "data") as writer:
        for _ in range(24):
            writer.add_document(np.append(rng.integers(2, len(vocab), 90), 1))
    return {"hf": hf, "data": root / "data", "out": root / "out"}


def test_eval_command_writes_records_table_and_plots(tiny) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "cp_train.eval", "--load", str(tiny["hf"]), "--data-path",
                           str(tiny["data"]), "--lengths", "96", "128", "--depths", "0", "1", "--trials", "1",
                           "--loss-samples", "2", "--output-dir", str(tiny["out"])],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tiny["out"] / "eval.jsonl").read_text().splitlines()]
    grids = [r for r in records if r["task"] in ("passkey", "niah")]
    buckets = [r for r in records if r["task"] == "loss_by_position"]
    assert len(grids) == 2 * 2 * 2 and all(list(r) == GRID_KEYS for r in grids)
    assert buckets and all(list(r) == LOSS_KEYS for r in buckets)
    assert [r["bucket_start"] for r in buckets] == [2 ** b for b in range(len(buckets))]
    assert buckets[-1]["bucket_end"] == 127 and sum(r["tokens"] for r in buckets) > 0  # documents of 91 tokens
    assert table(records) in done.stdout
    pytest.importorskip("matplotlib")
    for name in ("loss_by_position.png", "passkey_heatmap.png", "niah_heatmap.png"):
        assert (tiny["out"] / name).stat().st_size > 0


@pytest.mark.parametrize("args,words", [
    (["--tasks", "passkey", "haystack"], "unknown eval task 'haystack': choose from loss_by_position, passkey, niah"),
    (["--lengths", "256"], "exceeds the model's max_position_embeddings 128 and it has no RoPE scaling"),
    (["--lengths", "0"], "argument --lengths: must be a positive integer, got '0' (see cp-train-eval --help)"),
    (["--output-dir", "{hf}/config.json"], "--output-dir {hf}/config.json is a file: pass a directory"),
])
def test_bad_input_is_one_line(tiny, capsys, monkeypatch, tmp_path, args: list[str], words: str) -> None:
    """Each before the evaluation runs: the output directory too, so no result is lost at its end; a refused
    command leaves no empty output directory (``eval_out`` in the working directory) behind."""
    monkeypatch.chdir(tmp_path)
    args, words = [arg.format(hf=tiny["hf"]) for arg in args], words.format(hf=tiny["hf"])
    code = main(["--load", str(tiny["hf"]), "--data-path", str(tiny["data"]), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert list(tmp_path.iterdir()) == []


def test_filler_that_does_not_fit_is_one_line(tiny) -> None:
    from cp_train.data.tokenizers.hf import HFTokenizer

    tok = HFTokenizer(tiny["hf"])
    with pytest.raises(InputError) as caught:
        prompts.passkey_prompt(tok, 40, 0.5, 12345)
    assert "passkey at length 40" in str(caught.value) and "\n" not in str(caught.value)
    prompt = prompts.passkey_prompt(tok, 96, 0.5, 12345)
    assert len(prompt.tokens) == 96 and tok.decode(prompt.tokens[slice(*prompt.answer)]).replace(" ", "") == "12345"


def test_without_matplotlib_one_line(monkeypatch, tmp_path) -> None:
    import builtins

    from cp_train.eval.report import plots

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    paths, note = plots([{"task": "passkey", "length": 8, "depth": 0.0, "trials": 1, "accuracy": 1.0,
                          "key_logprob": 0.0}], tmp_path)
    assert paths == [] and note.startswith("matplotlib is not installed") and "\n" not in note


def test_periodic_eval_checks_its_section_and_is_due_at_its_steps() -> None:
    from cp_train.config.sources import load_config
    from cp_train.eval.periodic import PeriodicEval

    with pytest.raises(InputError, match="unknown eval task 'bogus'"):
        PeriodicEval(load_config(None, {}, ["eval.every=10", "eval.tasks=passkey,bogus"]))
    with pytest.raises(InputError, match="exceeds the model's max_position_embeddings 512"):
        PeriodicEval(load_config(None, {}, ["eval.every=10", "eval.lengths=1024", "model.max_position_embeddings=512"]))
    every = PeriodicEval(load_config(None, {}, ["eval.every=10"]))
    assert [step for step in range(1, 26) if every.due(step, 25)] == [10, 20, 25]
    assert not PeriodicEval(load_config(None, {}, [])).due(10, 25)  # off by default
