"""Mistral, Qwen2, Qwen3 and granite_swa <-> GPTModel: transformers' function in every layout, bitwise round trips.

Random tiny models of each family (a Mistral window shorter than the sequence, Qwen2 with ``use_sliding_window``
on and as Qwen2.5's configs ship it, Qwen3 with an explicit head_dim, a granite_swa with sinks and alternating
window layers, tied and untied heads) are saved with transformers and loaded with ``load_hf`` at (tp, cp) =
(1, 1), (1, 2) zigzag, (2, 2) zigzag with and without sequence parallelism and (1, 4) Ulysses; logits and loss
must equal transformers' within 1e-5 relative (fp32). One spawned world of 4 ranks serves every layout.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cp_train.config.flags import parse_config
from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate
from cp_train.model.config import ModelConfig
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.config import ATTENTION_FIELDS, HFConfigError, hf_config, model_fields, read_hf_config
from cp_train.model.hf.llama import load_hf, save_hf
from cp_train.parallel.mesh.state import run_with_parallel
from tests import hf_cases, hf_family_cases
from tests.numerics import rel_err

TOL = 1e-5
LAYOUTS = {  # (tp, cp) -> [(layout, algorithm, sequence_parallel[, only these models])], on one world of 4 ranks
    (1, 2): [("zigzag", "ring", False)],
    (2, 2): [("zigzag", "ring", True), ("zigzag", "ring", False, ("llama bias head_dim tied",))],
    (1, 4): [("zigzag", "ulysses", False)],
}
SHARDED = ("llama bias head_dim tied", "mistral window untied", "qwen2 window untied", "qwen2 released tied",
           "qwen3 window bias tied", "granite sinks untied")  # run sharded (the others differ only in shapes)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    tokens = torch.randint(0, hf_family_cases.BASE["vocab_size"], (2, hf_family_cases.SEQ),
                           generator=torch.Generator().manual_seed(2))
    paths, refs = hf_family_cases.build_all(root, tokens)
    return {"paths": paths, "refs": refs, "tokens": tokens}


def _check(results: dict, refs: dict, where: str) -> dict:
    failures = {}
    for key, got in results.items():
        name = next(n for n in refs if key.endswith(n))
        errors = {part: rel_err(got[part], refs[name][part]) for part in ("logits", "loss")}
        print(f"{where} {key}: {errors}")
        if max(errors.values()) > TOL:
            failures[f"{where} {key}"] = errors
    return failures


def test_unsharded_families_equal_transformers(families) -> None:
    results = {name: hf_cases.full_logits_and_loss(load_hf(path), families["tokens"])
               for name, path in families["paths"].items()}
    failures = _check(results, families["refs"], "(1, 1)")
    assert not failures, f"relative errors above {TOL}: {failures}"


def test_windows_and_sinks_matter(families) -> None:
    """Negative controls: without its window or its sinks a model must not match (the test would notice)."""
    for name in ("mistral window untied", "granite sinks untied"):
        model = load_hf(families["paths"][name])
        for layer in model.layers:
            layer.attention.window = None if "mistral" in name else layer.attention.window
            if "granite" in name:
                layer.attention.sinks = None
        got = hf_cases.full_logits_and_loss(model, families["tokens"])
        assert rel_err(got["logits"], families["refs"][name]["logits"]) > 1e-3, name


def test_sharded_families_equal_transformers(spawn_world, families) -> None:
    world, failures = spawn_world(4), {}
    paths = {name: families["paths"][name] for name in SHARDED}
    for (tp, cp), layouts in LAYOUTS.items():
        per_rank = world.run(run_with_parallel, (tp, cp, None), hf_family_cases.logits_at_layouts, layouts, paths,
                             families["tokens"])
        for rank, results in enumerate(per_rank):
            assert len(results) == sum(len(layout[3]) if len(layout) > 3 else len(paths) for layout in layouts)
            failures.update(_check(results, families["refs"], f"rank {rank} (tp, cp) = ({tp}, {cp})"))
    assert not failures, f"relative errors above {TOL}: {failures}"


def test_init_from_hf_takes_each_family(families) -> None:
    for name, path in families["paths"].items():
        model, fields = parse_config(["--init-from-hf", path]).model, model_fields(read_hf_config(path))
        assert {k: getattr(model, k) for k in (*ATTENTION_FIELDS, "hf_architecture")} == \
            {k: fields[k] for k in (*ATTENTION_FIELDS, "hf_architecture")}, name
    qwen3 = families["paths"]["qwen3 head_dim untied"]
    assert parse_config(["--init-from-hf", qwen3]).model.head_dim == 24
    with pytest.raises(ConfigError, match=r"model.qk_norm=False \(config.json qk_norm: True\)"):
        parse_config(["--init-from-hf", qwen3, "--set", "model.qk_norm=false"])
    granite = families["paths"]["granite sinks untied"]
    compiled = parse_config(["--init-from-hf", granite, "--set", "train.compile=true", "--set", "data.seq_len=64"])
    validate(compiled, 1)  # sinks compile (the operator's backward returns their gradient)
    assert compiled.model.attention_sinks and compiled.train.compile


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_round_trips_are_bitwise_and_keep_the_architecture(families, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    for name, path in families["paths"].items():
        source = json.loads((hf_family_cases.Path(path) / "config.json").read_text())
        target = save_hf(load_hf(path), tmp_path / name.replace(" ", "-"))
        expected, got = _tensors(hf_family_cases.Path(path)), _tensors(target)
        assert got.keys() == expected.keys(), name
        assert all(torch.equal(got[k], expected[k]) for k in expected), f"{name}: not bitwise equal"
        written = json.loads((target / "config.json").read_text())
        assert written["architectures"] == source["architectures"], name
        if name in ("granite sinks untied", "qwen2 released tied", "qwen3 window bias tied"):
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            again = hf_cases.hf_reference(model, families["tokens"])
            assert rel_err(again["logits"], families["refs"][name]["logits"]) == 0.0, name


SHAPE = {"vocab_size": 64, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 48, "max_position_embeddings": 64}


@pytest.mark.parametrize("options,architecture", [
    ({}, "LlamaForCausalLM"),
    ({"attention_bias": True, "head_dim": 12}, "LlamaForCausalLM"),
    ({"sliding_window": 8}, "MistralForCausalLM"),
    ({"qkv_bias": True}, "Qwen2ForCausalLM"),
    ({"qkv_bias": True, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
     "Qwen2ForCausalLM"),
    ({"qk_norm": True, "head_dim": 24}, "Qwen3ForCausalLM"),
    ({"attention_sinks": True, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
     "GraniteSWAForCausalLM"),
    ({"attention_sinks": True, "hf_architecture": "LlamaForCausalLM"}, "GraniteSWAForCausalLM"),
])
def test_export_picks_the_architecture(options, architecture) -> None:
    written = hf_config(ModelConfig(**SHAPE, **options))
    assert written["architectures"] == [architecture]


@pytest.mark.parametrize("options,message", [
    ({"attention_sinks": True, "qk_norm": True}, "model.qk_norm = true is not supported: GraniteSWAForCausalLM"),
    ({"attention_sinks": True, "qkv_bias": True}, "model.qkv_bias = true is not supported: GraniteSWAForCausalLM"),
    ({"qk_norm": True, "hf_architecture": "LlamaForCausalLM"}, "model.qk_norm = true is not supported: Llama"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
     "model.qkv_bias = false is not supported: Qwen2ForCausalLM cannot represent it exactly"),
    ({"sliding_window": 8, "hf_architecture": "LlamaForCausalLM"}, "model.sliding_window = 8 is not supported"),
])
def test_export_refuses_what_no_architecture_represents(options, message) -> None:
    with pytest.raises(HFConfigError, match=message.replace("(", r"\(")):
        hf_config(ModelConfig(**SHAPE, **options))


@pytest.mark.parametrize("options,message", [
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_layers = 2"),
    ({"layer_types": ["full_attention", "local"], "sliding_window": 4}, "layer_types: unknown local"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention layers but sliding_window is null"),
    ({"sliding_window": 0}, "sliding_window must be an integer >= 1"),
    ({"head_dim": 7}, "head_dim must be an even integer >= 2"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic' cannot be trained: its theta depends on the current sequence length"),
])
def test_bad_attention_options_are_one_line(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**SHAPE, **options).validate()


def test_tensor_parallel_shards_of_the_new_parameters() -> None:
    """Biases of the fused QKV and the sinks split with the heads, the output bias and the qk-norms replicated."""
    model = GPTModel(ModelConfig(**SHAPE, attention_bias=True, qk_norm=True, attention_sinks=True, head_dim=12))
    attention = model.layers[0].attention
    assert attention.qkv.bias.shape == (8 * 12,) and attention.qkv.bias.partition_dim == 0
    assert attention.sinks.shape == (4,) and attention.sinks.partition_dim == 0
    assert not getattr(attention.proj.bias, "tensor_model_parallel", False)
    assert attention.q_norm.weight.shape == (12,) and not getattr(attention.q_norm.weight, "tensor_model_parallel",
                                                                  False)
    assert 0.0 < attention.sinks.detach().std() < 0.1  # normal(0, init_std) as gpt-oss draws them
