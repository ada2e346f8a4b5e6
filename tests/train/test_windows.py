"""The tiny trainer with alternating sliding-window and full layers, learned sinks, qk-norm and q/k/v biases: the
same losses and first-step gradients at (tp, cp) = (1, 1), (1, 2) zigzag ring, (1, 2) Ulysses and (2, 2) (with
sequence parallelism), all within 1e-5. One spawned world of 4 ranks runs every layout (dp fills it). And a
granite_swa model (sinks, window layers) trained from ``--init-from-hf`` at tp 2 x cp 2, exported from its DCP
checkpoint, is the trained model in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from cp_train.checkpoint.export_hf import export_checkpoint
from cp_train.parallel.mesh.state import run_with_parallel
from tests import hf_cases, hf_family_cases, trainer_cases
from tests.numerics import rel_err

TOL = 1e-5
STEPS = 4
MODEL = {"model.layer_types": ["sliding_attention", "full_attention"], "model.sliding_window": 8,
         "model.attention_sinks": True, "model.qk_norm": True, "model.qkv_bias": True,
         "train.steps": STEPS, "train.micro_batch_size": 1, "train.valid_interval": 0}
LAYOUTS = {"tp1-cp1": ((1, 1, 4), {}), "tp1-cp2-zigzag-ring": ((1, 2, 2), {}),
           "tp1-cp2-ulysses": ((1, 2, 2), {"parallel.cp_algorithm": "ulysses"}), "tp2-cp2": ((2, 2, 1), {})}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module")
def runs(spawn_world, corpus, tmp_path_factory) -> dict[str, dict]:
    out = {}
    for name, (sizes, overrides) in LAYOUTS.items():
        run_dir = str(tmp_path_factory.mktemp(f"run-{name}"))
        out[name] = spawn_world(4).run(run_with_parallel, sizes, trainer_cases.train_layout, corpus, run_dir,
                                       {**MODEL, **overrides})[0]
    return out


def test_window_and_sink_losses_match_across_layouts(runs) -> None:
    reference = runs["tp1-cp1"]
    assert list(reference["losses"]) == list(range(1, STEPS + 1))
    grads = reference["grads"]
    assert any(name.endswith("attention.sinks") for name in grads) and any("q_norm" in name for name in grads)
    for name, run in runs.items():
        losses = [rel_err(run["losses"][s], reference["losses"][s]) for s in reference["losses"]]
        worst = max(rel_err(run["grads"][k], grads[k]) for k in grads)
        print(f"{name}: worst loss error {max(losses):.3g}, worst first-step gradient error {worst:.3g}")
        assert max(losses) <= TOL, (name, losses)
        assert worst <= TOL, name
    # the setup record's K/V bytes per layer: the window layer receives less than the full one under the ring
    moved = runs["tp1-cp2-zigzag-ring"]["setup"]["kv_bytes_per_layer"]
    assert 0 < moved["window 8"] < moved["full"], moved
    assert runs["tp1-cp1"]["setup"]["kv_bytes_per_layer"] == {}


def test_granite_from_hf_trains_and_exports(spawn_world, corpus, tmp_path) -> None:
    family, overrides = hf_family_cases.VARIANTS["granite sinks untied"]
    shape = {"hidden_size": 32, "intermediate_size": 64, "attention_multiplier": 8**-0.5}  # trainer_cases' shape
    hf_dir = tmp_path / "granite"
    hf_family_cases.make_hf_model(hf_dir, family, seed=4, **{**overrides, **shape})
    tokens = torch.randint(0, trainer_cases.VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    run = {"checkpoint.init_from_hf": str(hf_dir), "checkpoint.save": str(tmp_path / "checkpoints"),
           "train.steps": 2, "train.micro_batch_size": 1, "train.valid_interval": 0}
    trained = spawn_world(4).run(run_with_parallel, (2, 2, 1), hf_cases.train_from_hf_on_rank, corpus,
                                 str(tmp_path / "run"), run, tokens)[0]
    out = export_checkpoint(tmp_path / "checkpoints", tmp_path / "exported")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GraniteSWAForCausalLM"] and config["layer_types"] == overrides["layer_types"]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        error = rel_err(exported(tokens).logits, trained["logits"])
    print(f"granite_swa tp=2 x cp=2 -> DCP -> export -> transformers: logits relative error {error:.3g}")
    assert error <= TOL


def test_the_compiled_model_differentiates_windows_and_sinks() -> None:
    """``GPTModel.compile_parts`` (``train.compile``) with a window layer and sinks: the loss and every gradient,
    the sinks' included, equal eager (the operator's backward returns dsinks, its fake the sinks' shape)."""
    import copy

    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, max_position_embeddings=64, attention_sinks=True,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    eager = GPTModel(config)
    compiled = copy.deepcopy(eager)
    compiled.compile_parts()
    tokens = torch.randint(0, 64, (2, 33))

    def grads(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    (loss, expected), (got_loss, got) = grads(eager), grads(compiled)
    assert rel_err(got_loss, loss) < 1e-6
    assert any("sinks" in name for name in expected)
    for name, grad in expected.items():
        assert rel_err(got[name], grad) < 1e-5, name


def test_the_mfu_counts_each_window_layers_pairs() -> None:
    """``model.family`` counts a window layer's keys exactly (``window_pairs``), and the pairs the trainer counts
    per batch are the layers' plans' pairs averaged (the window's own for a window layer)."""
    from cp_train.model.config import ModelConfig
    from cp_train.model.family import keys_per_query, model_flops_per_token
    from cp_train.model.gpt import GPTModel
    from cp_train.parallel.cp.plan.segments import Window, window_pairs

    for seq, window in ((64, 8), (64, 1), (5, 2), (64, 63)):
        assert keys_per_query(seq, window) * seq == window_pairs(seq, True, Window(window - 1, 0))
    assert keys_per_query(64, 64) == keys_per_query(64, 100) == keys_per_query(64, None) == 32  # the convention
    base = dict(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                max_position_embeddings=64)
    full, windowed = ModelConfig(**base), ModelConfig(**base, layer_types=["sliding_attention", "full_attention"],
                                                      sliding_window=8)
    assert model_flops_per_token(windowed, 64) < model_flops_per_token(full, 64)
    model = GPTModel(windowed)
    documents = torch.tensor([[0] * 20 + [1] * 44])
    plan = model.build_cp_plan(64, documents)
    plans = model.layer_plans(64, documents, None, plan)
    expected = (20 * 21 // 2 + 44 * 45 // 2 + sum(window_pairs(c, True, Window(7, 0)) for c in (20, 44))) / 2
    assert plan.pairs == 20 * 21 // 2 + 44 * 45 // 2 and model.mean_layer_pairs(plans) == expected


def test_the_loader_makes_every_windows_plan() -> None:
    """A windowed model's ``sample_planner`` makes the plans of every window in the loader (``LayerPlans``): the
    forward given them equals the forward that builds them, and counts the same pairs."""
    from cp_train.data.loader import rank_positions
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel
    from cp_train.parallel.cp.plan.layer_plans import LayerPlans

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                         max_position_embeddings=64, attention_sinks=True, sliding_window=5,
                         layer_types=["sliding_attention", "full_attention"])
    model = GPTModel(config)
    tokens, documents = torch.randint(0, 64, (1, 33)), torch.tensor([[0] * 12 + [1] * 20])
    positions = rank_positions(documents, 1, "contiguous")
    plans = model.sample_planner()(documents[None], positions)
    assert isinstance(plans, LayerPlans) and set(plans.windows) == {5}
    given = model(tokens[:, :-1], labels=tokens[:, 1:], document_ids=documents, plan=plans.to("cpu"))
    given_pairs = model.layer_pairs
    built = model(tokens[:, :-1], labels=tokens[:, 1:], document_ids=documents)
    assert torch.equal(given, built) and given_pairs == model.layer_pairs
