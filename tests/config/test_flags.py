"""The command line a Megatron user types: aliases mapped to config keys, ``--help`` listing every key by section,
the nearest key for an unknown flag, and errors in the right order with the obvious hint (one line each)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from cp_train.cli import plot as plot_cli
from cp_train.cli import train as train_script
from cp_train.cli.plan import main as plan_main
from cp_train.config.flags import FLAGS, SWITCHES, build_parser, config_keys, parse_config
from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate
from cp_train.errors import InputError
from cp_train.run_parts import cp_tokens_warning
from tests import trainer_cases
from tests.entry_points import assert_one_line, run_many, write_config

ROOT = Path(__file__).resolve().parents[2]
CPU_TINY = str(ROOT / "launch" / "configs" / "cpu-tiny.yaml")
VALUES = {int: "3", float: "0.5", str: "cosine", str.lower: "linear"}
STRINGS = {"--cp-layout": "stripe", "--cp-algorithm": "ulysses", "--recompute-granularity": "full",
           "--wandb-mode": "offline", "--data-path": "x", "--tokenizer-model": "t.model", "--save": "c",
           "--load": "c", "--run-dir": "r", "--wandb-project": "p", "--valid-data-path": "v", "--profile-ranks": "1"}
CONVERTED = {"--split": ("98,1,1", "0.02")}  # flag -> (its value, the key's)


@pytest.mark.parametrize("flag", [name for flag, spec in FLAGS.items() for name in (flag, *spec[3])
                                  if spec[0] != "checkpoint.init_from_hf"])
def test_every_flag_and_alias_maps_to_its_set_form(flag) -> None:
    key, kind = next((spec[0], spec[1]) for name, spec in FLAGS.items() if flag in (name, *spec[3]))
    value = STRINGS.get(flag, VALUES.get(kind))
    value, set_value = CONVERTED.get(flag, (value, value))
    assert parse_config([flag, value]).to_dict() == parse_config(["--set", f"{key}={set_value}"]).to_dict()


def test_switches_map_to_their_set_form_and_help_lists_every_key() -> None:
    for flag, (key, value, _) in SWITCHES.items():
        assert parse_config([flag]).to_dict() == parse_config(["--set", f"{key}={value}"]).to_dict(), flag
    text = build_parser().format_help()
    keys = [key for section in config_keys().values() for key, _, _ in section]
    assert len(keys) > 80 and [key for key in keys if key not in text] == []
    for section in config_keys():
        assert f"\n{section}:\n" in text, section
    assert "--set model.KEY=VALUE" in text and "[model.num_layers: int = 12]" in text
    assert "model.rope_theta: float = 10000.0" in text


@pytest.mark.parametrize("argv,hint", [
    (["--n-layers", "2"], "did you mean --num-layers 2 (--set model.num_layers=2)?"),
    (["--rope-thetta", "5e5"], "did you mean --rope-theta 5e5 (--set model.rope_theta=5e5)?"),
    (["--decay-steps", "10"], "did you mean --set schedule.decay_steps=10?"),
    (["--tensor-parallel", "2"], "did you mean --tensor-model-parallel-size 2 (--set parallel.tp=2)?"),
])
def test_an_unknown_flag_suggests_the_nearest_key(argv, hint) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"unrecognized arguments: {' '.join(argv)}: {hint}")):
        parse_config(argv)


def test_list_keys_take_a_comma_list_or_a_yaml_list() -> None:
    for layer_types, lengths, imports in (("full_attention,sliding_attention", "64,128", "json"),
                                          ("[full_attention, sliding_attention]", "[64, 128]", "[json]")):
        config = parse_config(["--set", "model.num_layers=2", "--set", f"model.layer_types={layer_types}",
                               "--set", f"eval.lengths={lengths}", "--set", f"train.imports={imports}"])
        assert config.model.layer_types == ["full_attention", "sliding_attention"], layer_types
        assert config.eval.lengths == [64, 128] and config.train.imports == ["json"], lengths
    with pytest.raises(ConfigError, match=r"eval\.lengths expects a list, as a,b or \[a, b\]; got '\[64,'"):
        parse_config(["--set", "eval.lengths=[64,"])


@pytest.mark.parametrize(("argv", "words"), [
    (["--device-memory-gib", "0"], "argument --device-memory-gib: must be a positive number, got '0'"),
    (["--device-memory-gib", "-5"], "argument --device-memory-gib: must be a positive number, got '-5'"),
    (["--reserve-gib", "-1"], "argument --reserve-gib: must be 0 or more, got '-1'"),
    (["--reserve-fraction", "2"], "argument --reserve-fraction: must be at least 0 and below 1"),
    (["--device-memory-gib", "3"], "--reserve-gib 3 + --reserve-fraction 0.05 of the 3 GiB of the device keep "
                                   "3.15 GiB, all of its memory: lower them or raise --device-memory-gib"),
])
def test_dry_run_memory_flags_are_checked(capsys, argv: list[str], words: str) -> None:
    assert train_script.main(["--config", CPU_TINY, "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and len(err.splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("value", ["", "two", "0"])
def test_a_world_size_that_is_not_a_count_is_one_line(monkeypatch, capsys, value: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", value)
    assert train_script.main(["--config", CPU_TINY, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == (f"train.py: error: WORLD_SIZE={value!r} is not a number of processes: unset it for one process, "
                   f"or launch with torchrun, which sets it\n"), err


@pytest.mark.parametrize(("content", "words"), [
    (b"", "is empty: it holds no settings"),
    (b"# a comment, no settings\n", "is empty: it holds no settings"),
    (b"model:\n  num_layers: \xd0\xff\n", "is not a YAML text file (byte 0xd0 at offset 21 is not UTF-8 text)"),
])
def test_an_empty_or_binary_config_file_is_one_line(tmp_path, capsys, content: bytes, words: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert train_script.main(["--config", str(path), "--dry-run"]) == 2  # not the default model, silently
    err = capsys.readouterr().err
    assert err.startswith(f"train.py: error: --config {path} {words}") and len(err.splitlines()) == 1, err
    assert plan_main([str(path), "--seq-len", "64", "--gpus", "8"]) == 2  # the planner names its argument
    err = capsys.readouterr().err
    assert err.startswith(f"cp-train-plan: model config {path} {words}") and len(err.splitlines()) == 1, err


def test_a_length_above_the_positions_names_both_fixes_and_cp_tokens_warn() -> None:
    config = parse_config(["--config", CPU_TINY, "--seq-len", "1024"])
    with pytest.raises(ConfigError, match=r"data\.seq_len 1024 exceeds model\.max_position_embeddings 512: for a "
                                          r"model trained from scratch raise it \(--max-position-embeddings 1024\); "
                                          r"for a pretrained model extend its context with RoPE scaling \(--set "
                                          r"model\.rope_scaling='\{rope_type: yarn, factor: 2\.0\}'"):
        validate(config, 2)
    eight = parse_config(["--config", CPU_TINY, "--cp-size", "8"])
    assert cp_tokens_warning(eight) == ("warning: each CP rank holds 32 tokens (data.seq_len 256 / cp 8), fewer "
                                        "than CP pays for (about 512): use a smaller --cp-size (1 at this length) "
                                        "or a longer --seq-len (at least 4096)",)
    assert cp_tokens_warning(parse_config(["--config", CPU_TINY, "--seq-len", "2048", "--cp-size", "2"])) == ()


def test_plot_without_matplotlib_names_the_pip_install(monkeypatch, tmp_path, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_cli.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("python -m cp_train.cli.plot: error: plots need matplotlib, which is not "
                                       "installed: pip install matplotlib\n")
    with pytest.raises(InputError):
        plot_cli.run([str(tmp_path)])


def test_errors_come_in_the_right_order_with_the_obvious_hint(tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    cp2 = str(write_config(tmp_path / "cp2.yaml", corpus, tmp_path / "run", cp=2))
    cp1 = str(write_config(tmp_path / "cp1.yaml", corpus, tmp_path / "run1"))
    missing = str(tmp_path / "missing")
    cases = {  # a file missing is named before the settings derived from it and before the world's size
        "missing data": (["--config", CPU_TINY, "--data-path", missing], 1,
                         rf"data\.prefix {missing}: {missing}\.idx is missing; an indexed dataset needs both "
                         rf"missing\.idx and missing\.bin \(make them with cp-train-preprocess\)$"),
        "missing tokenizer": (["--config", CPU_TINY, "--tokenizer-model", "nope.model"], 1,
                              r"data\.tokenizer nope\.model does not exist: .*train a SentencePiece model on text "
                              r"files with python -m cp_train\.cli\.train_tokenizer --input FILE\.\.\."),
        "torchrun forgotten": (["--config", CPU_TINY], 1,
                               r"this is one process \(world size 1\) and parallel\.tp\*cp\*dp = 2 needs 2: launch "
                               r"with torchrun --nproc-per-node 2 train\.py"),
        "no config": (["--train-steps", "5"], 1, r"launch with torchrun --nproc-per-node 2 train\.py"),
        "warmup": (["--config", cp1, "--train-steps", "2", "--lr-warmup-iters", "5"], 1,
                   r"schedule\.warmup_steps 5 >= train\.steps 2: the run would never leave warmup"),
        "wandb online": (["--config", cp2, "--set", "logging.wandb=true", "--wandb-mode", "online"], 2,
                         r"wandb could not start its online run \(.*\): set WANDB_API_KEY or run `wandb login`"),
    }
    outcomes = {name: run_many({name: args}, world=world, launcher="launch")[name]
                for name, (args, world, _) in cases.items() if world == 2}
    outcomes |= run_many({name: args for name, (args, world, _) in cases.items() if world == 1})
    for name, (_, _, pattern) in cases.items():
        assert_one_line(outcomes[name], 2, pattern)  # one line: rank 0's alone, also for wandb
        assert "step 1/" not in outcomes[name].output, name
    assert "[cp-train] no --config: using " in outcomes["no config"].output


MEGATRON_LLAMA = (  # the model, optimizer, data and logging flags of a Megatron-LM Llama pretraining script
    "--use-mcore-models --transformer-impl transformer_engine --num-layers 2 --hidden-size 64 --ffn-hidden-size 160 "
    "--num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 128 "
    "--max-position-embeddings 128 --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm "
    "--norm-epsilon 1e-5 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --init-method-std 0.01 --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 "
    "0.95 --adam-eps 1e-8 --bf16 --overlap-grad-reduce --overlap-param-gather --no-masked-softmax-fusion "
    "--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 128 --data-path 0.5 a 0.5 b "
    "--data-cache-path cache --num-workers 2 --eod-mask-loss --reset-attention-mask --log-throughput "
    "--ckpt-format torch_dist --distributed-timeout-minutes 30 --wandb-exp-name llama --attention-softmax-in-fp32 "
    "--accumulate-allreduce-grads-in-fp32 --calculate-per-token-loss --log-memory-to-tensorboard --exit-interval 500 "
    "--exit-duration-in-mins 230 --exit-signal-handler --check-weight-hash-across-dp-replicas-interval 100").split()


def test_a_megatron_llama_command_line_reads_as_ours() -> None:
    """Megatron-LM's flags: its names of our keys set them; those that say what cp-train does anyway are one note;
    one that asks for something else, or has no equivalent, is one line saying what to do
    (``--use-distributed-optimizer``)."""
    with pytest.raises(ConfigError, match=r"--use-distributed-optimizer has no alias here: use --fsdp"):
        parse_config([*MEGATRON_LLAMA, "--use-distributed-optimizer"])
    config = parse_config(MEGATRON_LLAMA)
    model, optimizer, data = config.model, config.optimizer, config.data
    assert model.rope_theta == 500000.0
    assert (model.num_kv_heads, model.head_dim, model.norm_eps, model.init_std, model.tie_embeddings) == (
        2, 16, 1e-5, 0.01, False)
    assert (optimizer.beta1, optimizer.beta2, optimizer.eps, config.train.dtype) == (0.9, 0.95, 1e-8, "bf16")
    assert (data.prefix, data.cache_dir, data.num_workers, data.mask_eod_loss, data.document_mask) == (
        "0.5 a 0.5 b", "cache", 2, True, True)
    assert (config.parallel.timeout_minutes, config.logging.run_name) == (30.0, "llama")
    assert (config.train.exit_interval, config.train.exit_duration_minutes) == (500, 230.0)
    assert config.train.check_replicas_every == 100
    (note,) = [n for n in config.deprecations if "what cp-train does anyway" in n]
    assert note.startswith("command line: Megatron-LM's --") and note.endswith(": what cp-train does anyway, nothing "
                                                                        "to set (cp_train/config/foreign_flags.py)")
    for flag in ("--use-mcore-models", "--transformer-impl transformer_engine", "--normalization RMSNorm", "--swiglu",
                 "--attention-dropout 0.0", "--overlap-param-gather", "--make-vocab-size-divisible-by 128",
                 "--calculate-per-token-loss", "--exit-signal-handler"):
        assert f" {flag}," in note or f" {flag}:" in note, flag
    for argv, line in ((["--normalization", "LayerNorm"], "Megatron-LM's --normalization LayerNorm: here the norms are "
                        "RMSNorm; drop the flag (or pass --normalization RMSNorm)"),
                       (["--attention-dropout", "0.1"], "Megatron-LM's --attention-dropout 0.1: here there is no "
                        "dropout; drop the flag (or pass --attention-dropout 0)"),
                       (["--fp16"], "Megatron-LM's --fp16 has no alias here: cp-train computes in bf16 (--bf16"),
                       (["--rampup-batch-size", "16", "16", "1000"], "Megatron-LM's --rampup-batch-size has no "
                                                                     "alias here: there is no batch-size ramp-up")):
        with pytest.raises(ConfigError, match=re.escape(line)):
            parse_config(argv)
