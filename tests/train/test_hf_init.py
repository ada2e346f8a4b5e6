"""Training from a Hugging Face Llama and exporting back: ``--init-from-hf``, DCP resume, ``cp_train.export_hf``.

A tp=2 x cp=2 run with FSDP starts from a random transformers model (its exact weights, each rank reading
only its TP and FSDP shard), trains and saves a DCP checkpoint; the export of that checkpoint, loaded by
transformers, must give the trained model's logits, and ``save_llama`` of the sharded model must write the
same tensors. Resuming the run (in another layout, without FSDP) uses the DCP checkpoint, not the HF weights.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import Metadata

from cp_train.build import resolve_data
from cp_train.checkpoint.export_hf import export_checkpoint
from cp_train.checkpoint.files import DCP_METADATA, LATEST, META, step_dir_name
from cp_train.cli.export_hf import main as export_cli
from cp_train.cli.export_hf import run as export_main
from cp_train.config.flags import parse_config
from cp_train.config.hf_init import check_hf_weights
from cp_train.config.schema import ConfigError
from cp_train.data.tokenizers.spm import train_tokenizer
from cp_train.errors import InputError, run_entry_point
from cp_train.model.config import ModelConfig
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import load_llama, save_llama
from cp_train.parallel.mesh.state import run_with_parallel
from tests import hf_cases, trainer_cases
from tests.numerics import rel_err

TOL = 1e-5


def test_init_from_hf_train_export_resume(spawn_world, tmp_path) -> None:
    corpus = trainer_cases.write_corpus(tmp_path / "docs")
    hf_dir = tmp_path / "hf"
    hf_cases.make_hf_llama(hf_dir, seed=5, **hf_cases.TRAINER_SHAPE)
    checkpoints = tmp_path / "checkpoints"
    tokens = torch.randint(0, trainer_cases.VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    overrides = {"checkpoint.init_from_hf": str(hf_dir), "checkpoint.save": str(checkpoints), "train.steps": 3,
                 "parallel.fsdp": True}
    world = spawn_world(4)
    first = world.run(run_with_parallel, (2, 2, 1), hf_cases.train_from_hf_on_rank, corpus, str(tmp_path / "run"),
                      overrides, tokens, str(tmp_path / "saved"))
    reference = dict(load_llama(hf_dir).named_parameters())
    start = first[0]["start"]
    assert start.keys() == reference.keys()
    assert all(torch.equal(start[name], p.detach()) for name, p in reference.items()), "not the HF weights"
    assert any("initialised from the Hugging Face model" in m for m in first[0]["messages"]), first[0]["messages"]
    assert all(answer["read"] == answer["held"] for answer in first), "a rank read more than its shards"
    tp_replicated = sum(p.numel() for name, p in reference.items() if "norm" in name)  # held by both TP ranks
    total = sum(p.numel() for p in reference.values())
    assert sum(answer["held"] for answer in first) == total + tp_replicated, "the shards do not partition the model"

    out = export_main([str(checkpoints), str(tmp_path / "exported")])
    saved, exported_files = load_file(tmp_path / "saved" / "model.safetensors"), load_file(out / "model.safetensors")
    assert saved.keys() == exported_files.keys()  # save_llama gathers the FSDP x TP shards like the DCP export
    assert all(torch.equal(saved[name], exported_files[name]) for name in saved)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(tokens).logits
    error = rel_err(logits, first[0]["logits"])
    print(f"tp=2 x cp=2 DCP checkpoint -> export -> transformers: logits relative error {error:.3g}")
    assert error <= TOL
    assert rel_err(logits, hf_cases.hf_reference(load_hf(hf_dir), tokens)["logits"]) > 1e-3, "it trained"
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == trainer_cases.EOD and config["rms_norm_eps"] == 1e-6  # from the HF source
    # exporting again replaces the earlier weight files (a stale model.safetensors would be what loads)
    export_main([str(checkpoints), str(out), "--max-shard-gb", str(20_000 / 2**30)])
    shards = sorted(f.name for f in out.glob("model*.safetensors*"))
    assert "model.safetensors" not in shards and "model.safetensors.index.json" in shards and len(shards) > 2
    export_main([str(checkpoints), str(out)])
    assert sorted(f.name for f in out.glob("model*.safetensors*")) == ["model.safetensors"]
    source_weights = (hf_dir / "model.safetensors").read_bytes()
    with pytest.raises(InputError, match=r"is the tokenizer source .* would overwrite the model the run started"):
        export_main([str(checkpoints), str(hf_dir)])  # the run's init_from_hf directory
    assert (hf_dir / "model.safetensors").read_bytes() == source_weights
    with pytest.raises(InputError, match=r"config.json is a file: pass a directory"):
        export_main([str(checkpoints), str(out / "config.json")])

    resumed = world.run(run_with_parallel, (1, 2, 2), hf_cases.train_from_hf_on_rank, corpus,
                        str(tmp_path / "run2"), {**overrides, "train.steps": 4, "parallel.fsdp": False}, tokens)[0]
    assert any("resumed from" in m for m in resumed["messages"]), resumed["messages"]
    assert not any("initialised from the Hugging Face" in m for m in resumed["messages"])
    assert list(resumed["losses"]) == [4]


def load_hf(path):  # noqa: ANN001, ANN201 - transformers' model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):  # noqa: ANN201
    path = tmp_path_factory.mktemp("small-hf")
    save_llama(GPTModel(ModelConfig(vocab_size=128, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                                    ffn_hidden_size=64, max_position_embeddings=64, norm_eps=1e-6)), path)
    return path


def test_model_shape_comes_from_the_hf_config(small_hf) -> None:
    config = parse_config(["--init-from-hf", str(small_hf), "--set", "model.mlp_chunks=2",
                           "--set", "model.hidden_size=32", "--set", "model.vocab_size=null"])
    model = config.model
    assert (model.vocab_size, model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads,
            model.ffn_hidden_size, model.norm_eps, model.tie_embeddings) == (128, 2, 32, 4, 2, 64, 1e-6, False)
    assert model.mlp_chunks == 2 and model.max_position_embeddings == 64 and model.rope_scaling is None
    extended = parse_config(["--init-from-hf", str(small_hf), "--set", "model.max_position_embeddings=256",
                             "--set", "model.rope_scaling={rope_type: llama3, factor: 4.0, low_freq_factor: 1.0, "
                                      "high_freq_factor: 4.0}", "--set", "model.rope_theta=50000"])
    assert extended.model.max_position_embeddings == 256 and extended.model.rope_theta == 50000
    assert extended.model.rope_scaling["original_max_position_embeddings"] == 64  # the HF model's context


def test_conflicting_model_keys_are_listed(small_hf, tmp_path) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(["--init-from-hf", str(small_hf), "--set", "model.hidden_size=48", "--set",
                      "model.num_layers=2", "--set", "model.norm_eps=1e-5", "--set", "model.tie_embeddings=true"])
    text = str(error.value)
    assert f"checkpoint.init_from_hf={small_hf} takes the model's shape from {small_hf}/config.json" in text
    for conflict in ("model.hidden_size=48 (config.json hidden_size: 32)", "model.norm_eps=1e-05 (config.json "
                     "rms_norm_eps: 1e-06)", "model.tie_embeddings=True (config.json tie_word_embeddings: False)"):
        assert conflict in text
    assert "num_layers" not in text  # set to the HF value: no conflict
    with pytest.raises(ConfigError, match="checkpoint.init_from_hf: .*nowhere is not a directory"):
        parse_config(["--init-from-hf", str(tmp_path / "nowhere")])


@pytest.mark.parametrize(("args", "words"), [
    (["--tokenizer-from", "{tmp}/missing"], "--tokenizer-from {tmp}/missing is not a directory: pass a Hugging Face"),
    (["--tokenizer-from", "{tmp}"], "--tokenizer-from {tmp} holds no tokenizer: pass a Hugging Face model directory"),
    (["--max-shard-gb", "-1"], "argument --max-shard-gb: must be a positive number, got '-1'"),
])
def test_bad_export_flags_are_one_line_before_anything_is_written(tmp_path, capsys, args, words) -> None:
    args, words = [arg.format(tmp=tmp_path) for arg in args], words.format(tmp=tmp_path)
    assert export_cli([str(tmp_path), str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err and not (tmp_path / "out").exists(), err


def test_missing_or_damaged_hf_weights_are_input_errors(small_hf, tmp_path) -> None:
    model = parse_config(["--init-from-hf", str(small_hf)]).model
    check_hf_weights(small_hf, model)  # intact
    broken = tmp_path / "hf"
    shutil.copytree(small_hf, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(InputError, match=rf"^checkpoint\.init_from_hf \(--init-from-hf\) {broken}: model\.safetensors "
                                         rf"is truncated or not a safetensors file \(.*\): .*re-download or re-export"):
        check_hf_weights(broken, model)
    weights.unlink()
    with pytest.raises(InputError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json"):
        check_hf_weights(broken, model)
    save_llama(GPTModel(dataclasses.replace(model, num_layers=1)), broken)  # a layer short of its config.json
    (broken / "config.json").write_text((small_hf / "config.json").read_text())
    with pytest.raises(InputError, match=r"its weights lack 9 tensors its config.json implies \(model\.layers\.1\."):
        check_hf_weights(broken, model)


def test_export_needs_a_checkpoint(tmp_path, capsys) -> None:
    with pytest.raises(InputError, match="holds no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    for step in (2, 4):  # step 2 complete (meta.json, DCP metadata naming no shard), step 4 without its metadata
        (tmp_path / step_dir_name(step)).mkdir()
        (tmp_path / step_dir_name(step) / META).write_text(json.dumps({"step": step, "consumed_samples": 0,
                                                                       "layout": {}, "config": {}}))
    with open(tmp_path / step_dir_name(2) / DCP_METADATA, "wb") as handle:
        pickle.dump(Metadata(state_dict_metadata={}, storage_data={}), handle)
    (tmp_path / LATEST).write_text(step_dir_name(4))
    code = run_entry_point("export", lambda args: export_main(args) and None, [str(tmp_path), str(tmp_path / "out")])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line and "--load" not in line, line
    assert re.fullmatch(rf"export: error: {tmp_path}/latest names {step_dir_name(4)}, an incomplete checkpoint: .*; "
                        rf"export the newest complete checkpoint instead: {tmp_path}/{step_dir_name(2)}", line), line


def test_hf_model_with_a_larger_tokenizer_says_to_use_its_own(small_hf, tmp_path) -> None:
    """The HF model's vocabulary is fixed by its config.json: the fix is its tokenizer, not model.vocab_size."""
    tokenizer = train_tokenizer([Path(textwrap.__file__)], 400, tmp_path / "tok")
    config = parse_config(["--init-from-hf", str(small_hf), "--tokenizer-model", str(tokenizer),
                           "--data-path", str(tmp_path / "docs")])
    with pytest.raises(ConfigError, match=rf"the Hugging Face model {small_hf} has 128 token ids, fewer than the 400 "
                                          rf"of the tokenizer \S+tok.model: train it with its own tokenizer, "
                                          rf"--tokenizer-model {small_hf} \(data.tokenizer\)"):
        resolve_data(config, None)
