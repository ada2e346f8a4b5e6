"""Hugging Face Llama <-> GPTModel: the same function as transformers in every layout, bitwise round trips.

Random ``LlamaForCausalLM`` models (every RoPE scaling type, GQA/MHA/MQA, tied and untied heads) are
saved with transformers, loaded with ``load_llama`` at (tp, cp) = (1, 1), (1, 2) zigzag and (2, 2) and
run on sequences 4x the scaled models' original context; logits and loss must equal transformers'
within 1e-5 relative (fp32), and each rank must read exactly its TP shard of the weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cp_train.model.config import gate_up_block
from cp_train.model.hf.llama import _load_gate_up, load_llama, save_llama
from cp_train.model.hf.weights import INDEX_FILE, SINGLE_FILE, HFTensor, WeightFiles
from cp_train.model.mlp import pair_gate_up
from cp_train.parallel.mesh.state import run_with_parallel
from tests import hf_cases
from tests.numerics import rel_err

TOL = 1e-5
LAYOUTS = [(1, 2), (2, 2)]  # spawned; (1, 1) runs in the test process


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, hf_cases.BASE["vocab_size"], (2, hf_cases.SEQ), generator=generator)
    paths, refs = {}, {}
    for i, (name, overrides) in enumerate(hf_cases.VARIANTS.items()):
        path = root / name.replace(" ", "-")
        model = hf_cases.make_hf_llama(path, seed=i, **overrides)
        paths[name], refs[name] = str(path), hf_cases.hf_reference(model, tokens)
    return {"paths": paths, "refs": refs, "tokens": tokens, "root": root}


def _errors(got: dict, ref: dict) -> dict[str, float]:
    return {"logits": rel_err(got["logits"], ref["logits"]), "loss": rel_err(got["loss"], ref["loss"])}


def test_unsharded_model_equals_transformers(hf_models) -> None:
    failures = {}
    for name, path in hf_models["paths"].items():
        got = hf_cases.full_logits_and_loss(load_llama(path), hf_models["tokens"])
        errors = _errors(got, hf_models["refs"][name])
        print(f"(tp, cp) = (1, 1) {name}: {errors}")
        if max(errors.values()) > TOL:
            failures[name] = errors
    assert not failures, f"relative errors above {TOL}: {failures}"


@pytest.mark.parametrize("tp,cp", LAYOUTS)
def test_sharded_model_equals_transformers(spawn_world, hf_models, tp: int, cp: int) -> None:
    per_rank = spawn_world(4).run(run_with_parallel, (tp, cp, None), hf_cases.logits_on_rank, hf_models["paths"],
                                  hf_models["tokens"])
    failures = {}
    for rank, results in enumerate(per_rank):
        assert results.keys() == hf_models["paths"].keys()
        for name, got in results.items():
            assert got["read"] == got["held"], f"rank {rank} {name}: read {got['read']} weight elements for " \
                                               f"a shard of {got['held']}"
            errors = _errors(got, hf_models["refs"][name])
            if rank == 0:
                print(f"(tp, cp) = ({tp}, {cp}) {name}: {errors}")
            if max(errors.values()) > TOL:
                failures[f"rank {rank} {name}"] = errors
    assert not failures, f"(tp={tp}, cp={cp}) relative errors above {TOL}: {failures}"


def test_scaling_matters_beyond_the_original_context(hf_models) -> None:
    """Negative control: the same weights without the scaling must not match (the test would notice)."""
    for name, path in hf_models["paths"].items():
        if name.startswith("none"):
            continue
        model = load_llama(path)
        model.config.rope_scaling = None
        got = hf_cases.full_logits_and_loss(model, hf_models["tokens"])
        assert rel_err(got["logits"], hf_models["refs"][name]["logits"]) > 1e-3, name


def _assert_same_files(source, target) -> None:
    def tensors(path) -> dict[str, torch.Tensor]:
        out = {}
        for file in sorted(path.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    expected, got = tensors(source), tensors(target)
    assert got.keys() == expected.keys()
    differing = [n for n, t in expected.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)]
    assert not differing, f"not bitwise equal: {differing}"


def test_round_trip_is_bitwise(hf_models, tmp_path) -> None:
    source = hf_models["root"] / "llama3-gqa-tied"
    save_llama(load_llama(source), tmp_path / "fp32")
    _assert_same_files(source, tmp_path / "fp32")
    assert (tmp_path / "fp32" / SINGLE_FILE).is_file()
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["tie_word_embeddings"] is True

    sharded = tmp_path / "bf16-source"  # a sharded bf16 checkpoint, untied, loaded and saved in bf16
    hf_cases.make_hf_llama(sharded, seed=3, dtype=torch.bfloat16, max_shard_size="40KB")
    assert (sharded / INDEX_FILE).is_file()
    model = load_llama(sharded, dtype=torch.bfloat16)
    save_llama(model, tmp_path / "bf16", max_shard_bytes=30_000)
    assert (tmp_path / "bf16" / INDEX_FILE).is_file()
    _assert_same_files(sharded, tmp_path / "bf16")
    save_llama(load_llama(sharded), tmp_path / "bf16-via-fp32", dtype=torch.bfloat16)  # exact both ways
    _assert_same_files(sharded, tmp_path / "bf16-via-fp32")


def test_round_trip_from_tensor_parallel_ranks(spawn_world, hf_models, tmp_path) -> None:
    source = hf_models["root"] / "yarn-gqa-untied"
    spawn_world(4).run(run_with_parallel, (2, 2, None), hf_cases.round_trip_on_rank, str(source), str(tmp_path))
    assert (tmp_path / INDEX_FILE).is_file()  # gathered one tensor at a time into 40 kB shards
    _assert_same_files(source, tmp_path)


def test_transformers_loads_what_save_llama_writes(hf_models, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    for name in ("yarn mscale gqa untied", "linear mha tied"):
        save_llama(load_llama(hf_models["paths"][name]), tmp_path / name)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        got = hf_cases.hf_reference(model, hf_models["tokens"])
        assert rel_err(got["logits"], hf_models["refs"][name]["logits"]) == 0.0, name


@pytest.mark.parametrize("rows", [(0, 96), (24, 72), (5, 61), (13, 14), (90, 96)], ids=str)
def test_gate_up_rows_of_any_region_load_from_hf_tensors(tmp_path, rows: tuple[int, int]) -> None:
    """Any rows of the fused gate/up weight (whole blocks: one strided read per tensor; FSDP's uneven chunks: block
    by block) are HF's gate_proj and up_proj rows in alternating blocks (ffn 48, block 6), columns 2-5 of 7."""
    gate, up = torch.randn(48, 7), torch.randn(48, 7)
    save_file({"g": gate, "u": up}, tmp_path / SINGLE_FILE)
    entries = [HFTensor("u", (48, 7), "mlp.gate_up.weight", "up"), HFTensor("g", (48, 7), "mlp.gate_up.weight", "gate")]
    out = torch.empty(rows[1] - rows[0], 3)
    _load_gate_up(WeightFiles(tmp_path), entries, out, (slice(*rows), slice(2, 5)), gate_up_block(48))
    assert gate_up_block(48) == 6
    assert torch.equal(out, pair_gate_up(gate, up, 6)[rows[0]:rows[1], 2:5])
