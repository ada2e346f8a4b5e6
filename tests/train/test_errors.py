"""train.py's config, input and checkpoint errors through its real entry points (``python train.py``, a world
of one; ``torchrun`` and ``cp_train.cli.launch`` with 2 ranks): one line naming the key or file and what to change,
exit code 2 (config or input) or 1 (a failed run), no traceback unless ``--debug``.

Every case is a fresh process (mostly Python and torch start-up); ``run_many`` runs them two at a time.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest

from cp_train.checkpoint.dcp import LATEST, step_dir_name
from cp_train.checkpoint.files import find_checkpoint
from cp_train.config.flags import parse_config
from cp_train.data.tokenizers.spm import train_tokenizer
from cp_train.errors import InputError
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import save_llama
from tests import trainer_cases
from tests.entry_points import PROJECT_FRAME, assert_one_line, run, run_many, write_config

STEPS, INTERVAL = 6, 2  # the base checkpoints: step 2 (pruned by checkpoint.keep = 2), 4 and 6


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """A tiny run's config, and its checkpoints (saved every 2 of 6 steps) by ``python train.py``."""
    root = tmp_path_factory.mktemp("errors")
    corpus = trainer_cases.write_corpus(root / "docs")
    config = write_config(root / "run.yaml", corpus, root / "run", **{"train.steps": STEPS})
    done = run(["--config", str(config), "--save", str(root / "ckpt"), "--save-interval", str(INTERVAL)])
    assert done.returncode == 0, done.output[-3000:]
    return {"root": root, "config": str(config), "ckpt": root / "ckpt", "corpus": corpus}


def checkpoint_copy(base: dict, name: str) -> Path:
    copy = base["root"] / name
    shutil.copytree(base["ckpt"], copy)
    return copy


def test_checkpoint_keep_leaves_the_newest_two(base) -> None:
    ckpt = base["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == [LATEST, step_dir_name(4), step_dir_name(6)]
    assert (ckpt / LATEST).read_text().strip() == step_dir_name(6)


def test_config_errors(base, tmp_path) -> None:
    """Caught before torch.distributed starts: the file, the YAML line, the flag, the float that overflows."""
    (tmp_path / "bad.yaml").write_text("model:\n  hidden_size: [32, 64\ntrain:\n  steps: 3\n")
    config = base["config"]
    cases = {
        "missing file": (["--config", str(tmp_path / "missing.yaml")],
                         r"--config \S+missing\.yaml does not exist: pass an existing YAML file"),
        "directory": (["--config", str(tmp_path)], r"--config \S+ is a directory: pass a YAML file"),
        "YAML syntax": (["--config", str(tmp_path / "bad.yaml")],
                        r"bad\.yaml:3:6: not valid YAML: expected ',' or '\]', but got ':'; fix the file"),
        "lr overflow": (["--config", config, "--lr", "1e39"],
                        r"optimizer\.lr = 1e\+39 overflows the fp32 optimizer .*use a value like 3e-4"),
    }
    outcomes = run_many({name: args for name, (args, _) in cases.items()}
                        | {"debug": ["--config", str(tmp_path / "missing.yaml"), "--debug"]})
    for name, (_, pattern) in cases.items():
        assert_one_line(outcomes[name], 2, pattern)
    debug = outcomes["debug"]  # --debug adds the traceback
    assert debug.returncode == 2 and "Traceback" in debug.output and "does not exist" in debug.output


def test_input_errors_stop_before_step_1(base, tmp_path) -> None:
    tokenizer = train_tokenizer([Path(textwrap.__file__)], 400, tmp_path / "tok")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file, not a directory")
    (tmp_path / "file.model").write_text("not a tokenizer")
    config = base["config"]
    save_llama(GPTModel(parse_config(["--config", config]).model), tmp_path / "hf")  # the run's shape, no weights
    (tmp_path / "hf" / "model.safetensors").unlink()
    checkpoint = checkpoint_copy(base, "save-is-a-checkpoint") / step_dir_name(6)
    cases = {
        "vocab": (["--config", config, "--set", f"data.tokenizer={tokenizer}", "--set", "model.vocab_size=128"],
                  r"model\.vocab_size 128 is smaller than the 400 ids of the tokenizer \S+tok\.model: set "
                  r"model\.vocab_size >= 400 \(e\.g\. 512\) or null"),
        "other tokenizer": (["--config", config, "--set", "model.vocab_size=64"],
                            r"data\.prefix \S+docs: \S+docs\.bin holds token id 127, outside the model's 64 ids: it "
                            r"was tokenized with another tokenizer"),
        "save dir": (["--config", config, "--save", str(not_a_dir / "ckpt")],
                     r"checkpoint\.save \(--save\) \S+file/ckpt is not a writable directory \(Not a directory\)"),
        "run dir": (["--config", config, "--run-dir", str(not_a_dir / "run")],
                    r"logging\.dir \(--run-dir\) \S+file/run is not a writable directory \(Not a directory\)"),
        "data": (["--config", config, "--data-path", str(tmp_path / "nothing")],
                 r"data\.prefix \S+nothing: \S+nothing\.idx is missing"),
        "tokenizer": (["--config", config, "--set", f"data.tokenizer={not_a_dir}.model"],
                      r"data\.tokenizer \S+file\.model: \S+file\.model is not a SentencePiece model \(.*\): pass a "
                      r"\.model file trained by sentencepiece"),
        "HF weights missing": (["--config", config, "--init-from-hf", str(tmp_path / "hf")],
                               r"checkpoint\.init_from_hf \(--init-from-hf\) \S+hf: \S+hf has neither "
                               r"model\.safetensors nor model\.safetensors\.index\.json: its weights are missing or "
                               r"damaged; re-download or re-export the model into it"),
        "save is a checkpoint": (["--config", config, "--save", str(checkpoint)],
                                 rf"checkpoint\.save \(--save\) \S+{step_dir_name(6)} is a checkpoint "
                                 rf"\({step_dir_name(6)}\), not a directory of checkpoints: pass its parent"),
        "no validation document": (["--config", config, "--set", "data.valid_fraction=0.0001", "--eval-interval", "2"],
                                   r"data\.valid_fraction 0\.0001 leaves no validation document of the \d+ in \S+: "
                                   r"raise it to at least \S+, or set train\.valid_interval=0"),
    }
    outcomes = run_many({name: args for name, (args, _) in cases.items()})
    for name, (_, pattern) in cases.items():
        assert_one_line(outcomes[name], 2, pattern)
        assert "step 1/" not in outcomes[name].output, name
    assert not list(checkpoint.glob("step_*")), "nothing nested in the checkpoint"


def test_damaged_checkpoints_name_the_file_and_the_load_to_use(base) -> None:
    """Auto-resume from a checkpoint directory whose newest checkpoint is damaged."""
    newest, previous = step_dir_name(6), step_dir_name(4)
    damage = {
        "truncated meta.json": lambda d: (d / newest / "meta.json").write_text('{"step": 6, "consu'),
        "truncated shard": lambda d: (d / newest / "__0_0.distcp").write_bytes(b"\0" * 100),
        "missing shard": lambda d: (d / newest / "__0_0.distcp").unlink(),
        "missing .metadata": lambda d: (d / newest / ".metadata").unlink(),
        "latest names a partial save": lambda d: ((d / step_dir_name(8) / "rng").mkdir(parents=True),
                                                  (d / LATEST).write_text(step_dir_name(8) + "\n")),
    }
    problems = {
        "truncated meta.json": rf"{newest}/meta\.json is truncated or damaged \(not valid JSON\)",
        "truncated shard": rf"shard \S+{newest}/__0_0\.distcp is truncated \(100 bytes, \.metadata needs \d+\)",
        "missing shard": rf"shard \S+{newest}/__0_0\.distcp is missing",
        "missing .metadata": rf"{newest}/\.metadata is missing",
        "latest names a partial save": rf"{step_dir_name(8)}/meta\.json is missing",
    }
    cases = {}
    for name, apply in damage.items():
        copy = checkpoint_copy(base, name.replace(" ", "-"))
        apply(copy)
        cases[name] = ["--config", base["config"], "--save", str(copy), "--train-steps", "8"]
    outcomes = run_many(cases)
    for name, args in cases.items():
        copy, named = args[3], step_dir_name(8) if name == "latest names a partial save" else newest
        good = newest if name == "latest names a partial save" else previous
        assert_one_line(outcomes[name], 2, rf"{re.escape(copy)}/latest names {named}, an incomplete checkpoint: "
                                           rf"\S*{problems[name]}; resume from the newest complete checkpoint with "
                                           rf"--load {re.escape(copy)}/{good}$")


def test_lost_latest_and_fewer_steps_than_the_checkpoint_stop_with_the_fix(base) -> None:
    """A save directory whose `latest` is gone is not started afresh (that would prune its checkpoints); a
    checkpoint beyond train.steps says so."""
    copy = checkpoint_copy(base, "no-latest")
    (copy / LATEST).unlink()
    outcomes = run_many({"no latest": ["--config", base["config"], "--save", str(copy)],
                         "beyond": ["--config", base["config"], "--load", str(base["ckpt"]), "--train-steps", "3",
                                    "--lr-warmup-iters", "1"]})
    assert_one_line(outcomes["no latest"], 2, rf"checkpoint\.save \(--save\) {re.escape(str(copy))} holds checkpoints "
                                              rf"but no `latest`: resume from the newest complete one with --load "
                                              rf"{re.escape(str(copy))}/{step_dir_name(6)}, or start a new run")
    assert sorted(p.name for p in copy.iterdir()) == [step_dir_name(4), step_dir_name(6)]  # nothing pruned
    assert_one_line(outcomes["beyond"], 2, rf"checkpoint \S+{step_dir_name(6)} is at step 6, beyond train\.steps 3: "
                                           rf"raise --train-steps, or start a new run with another --save")


def test_an_empty_latest_names_itself_and_the_checkpoint_to_load(base) -> None:
    copy = checkpoint_copy(base, "empty-latest")
    for content in (b"", b"\n  \n", b"\xd0\xff\x00"):  # empty, blank, not text
        (copy / LATEST).write_bytes(content)
        with pytest.raises(InputError, match=rf"^{re.escape(str(copy / LATEST))} is empty or damaged: it names no "
                                             rf"checkpoint; resume from the newest complete checkpoint with --load "
                                             rf"{re.escape(str(copy / step_dir_name(6)))}$"):
            find_checkpoint(copy)


def test_resume_changes_rng_files_and_non_finite_loss(base) -> None:
    def resume(name: str, *extra: str) -> list[str]:  # a copy of the checkpoints, and a run directory of its own
        copy = checkpoint_copy(base, name)
        return ["--config", base["config"], "--save", str(copy), "--run-dir", str(base["root"] / f"run-{name}"),
                *extra]

    cases = {
        "refused": resume("refused", "--train-steps", "8", "--seq-len", "16", "--set", "model.num_layers=3"),
        "allowed": resume("allowed", "--train-steps", "8", "--global-batch-size", "8", "--set",
                          "checkpoint.allow_changes=train.global_batch_size", "--lr", "1e-3"),
        "no rng": resume("no-rng", "--train-steps", "8"),
        "nan": resume("nan", "--train-steps", "12", "--lr", "1e30", "--set", "optimizer.clip_grad=0",
                      "--set", "checkpoint.interval=0"),
    }
    no_rng = cases["no rng"][3]
    (Path(no_rng) / step_dir_name(6) / "rng" / "rank_00000.pt").unlink()
    outcomes = run_many(cases)
    assert_one_line(outcomes["refused"], 2, r"checkpoint \S+step_00000006 was saved with another data stream or "
                                            r"model: model\.num_layers 2 -> 3, data\.seq_len 32 -> 16; .*--set "
                                            r"checkpoint\.allow_changes=model\.num_layers,data\.seq_len$")
    allowed = outcomes["allowed"]
    assert allowed.returncode == 0, allowed.output[-3000:]
    assert ("[cp-train] accepted changes since the checkpoint (checkpoint.allow_changes): "
            "train.global_batch_size 4 -> 8") in allowed.output
    assert "changed since the checkpoint: optimizer.lr 0.003 -> 0.001, train.steps 6 -> 8" in allowed.output
    no_rng_run = outcomes["no rng"]
    assert no_rng_run.returncode == 0, no_rng_run.output[-3000:]
    assert (f"[cp-train] {no_rng}/{step_dir_name(6)}/rng/rank_00000.pt missing (RNG states of the checkpoint): "
            f"RNG re-derived from train.seed 1234 at step 6 on every rank") in no_rng_run.output
    load = f"{cases['nan'][3]}/{step_dir_name(6)}"
    assert_one_line(outcomes["nan"], 1, rf"(loss|gradient norm) is (nan|inf) at step \d+.*: stopping the run.*; "
                                        rf"the last checkpoint is {re.escape(load)}: resume from it with --load "
                                        rf"{re.escape(load)}")


@pytest.mark.parametrize("launcher", ["torchrun", "launch"])
def test_two_ranks_print_a_config_error_once(base, tmp_path, launcher) -> None:
    """Under torchrun rank 0 alone prints the error; torchrun's summary shows it with the ranks' exit code 2 and
    no traceback from the project; cp_train.cli.launch ends with one line and exit code 2."""
    config = write_config(tmp_path / "cp2.yaml", base["corpus"], tmp_path / "run", cp=2)
    outcome = run(["--config", str(config), "--seq-len", "30"], world=2, launcher=launcher)
    message = r"data\.seq_len 30 is not divisible by 2\*cp = 4 for the zigzag layout"
    if launcher == "launch":
        assert_one_line(outcome, 2, message)
        summary = outcome.lines("cp_train.cli.launch: ")  # torchrun may stop the other rank before it exits
        assert len(summary) == 1 and re.fullmatch(r"cp_train\.cli\.launch: train\.py failed with exit code 2 \((exit "
                                                  r"code 2|killed by SIGTERM) on ranks? .*\)", summary[0]), summary
        return
    lines = outcome.lines("train.py: ")
    assert outcome.returncode == 1 and len(lines) == 1 and re.search(message, lines[0]), outcome.output[-3000:]
    summary = outcome.output[outcome.output.index("Root Cause"):]
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: 2 ", summary) and re.search(message, summary), summary
    assert not PROJECT_FRAME.search(outcome.output), outcome.output[-3000:]
