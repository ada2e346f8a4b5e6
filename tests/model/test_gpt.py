"""The GPT model in one process: config errors, init, RoPE, chunked MLP, checkpointing, loss, FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_train.model import GPTModel, ModelConfig, matmul_params, model_flops_per_token
from cp_train.model.mlp import MLP
from cp_train.model.rope import apply_rope, rope_tables
from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.mesh.model_parallel import ModelParallel
from tests.model_cases import global_batch, step, tiny_config
from tests.numerics import rel_err


@pytest.mark.parametrize("overrides,tp,cp,seq,message", [
    ({"num_heads": 6, "num_kv_heads": 2, "hidden_size": 48}, 4, 1, None, "num_heads 6 is not divisible by tp = 4"),
    ({"num_kv_heads": 2}, 4, 1, None, "num_kv_heads 2 is not divisible by tp = 4"),
    ({"num_kv_heads": 3}, 1, 1, None, "num_heads 4 is not divisible by num_kv_heads 3"),
    ({"hidden_size": 30}, 1, 1, None, "hidden_size 30 is not divisible by num_heads 4"),
    ({"hidden_size": 12}, 1, 1, None, r"head_dim = hidden_size / num_heads = 3 must be even"),
    ({"vocab_size": 129}, 2, 1, None, "vocab_size 129 is not divisible by tp = 2; choose a tp that divides"),
    ({"ffn_hidden_size": 65}, 2, 1, None, "ffn_hidden_size 65 is not divisible by tp = 2"),
    ({}, 1, 4, 6, r"sequence length 6 is shorter than 2\*cp = 8 for the zigzag layout at cp=4"),
    ({}, 1, 4, 12, r"sequence length 12 is not divisible by 2\*cp = 8 for the zigzag layout"),
    ({"layout": "contiguous"}, 1, 4, 3, "sequence length 3 is shorter than cp = 4"),
    ({}, 1, 1, 128, "sequence length 128 exceeds max_position_embeddings 64"),
    ({"layout": "spiral"}, 1, 1, None, "unknown CP layout 'spiral'"),
    ({"attention_kernel": "xformers"}, 1, 1, None, "unknown attention_kernel 'xformers'"),
    ({"mlp_chunks": 0}, 1, 1, None, "mlp_chunks must be an integer >= 1"),
    ({}, 0, 1, None, "tp must be an integer >= 1"),
])
def test_config_errors_say_what_to_change(overrides, tp, cp, seq, message) -> None:
    layout = overrides.pop("layout", "zigzag")
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides).validate(tp, cp, seq, layout)
    tiny_config().validate(2, 2, 32)  # the base config is fine


def test_derived_defaults() -> None:
    config = ModelConfig(hidden_size=768, num_heads=12)
    assert (config.num_kv_heads, config.ffn_hidden_size, config.head_dim) == (12, 2048, 64)
    config.hidden_size, config.num_heads, config.num_kv_heads, config.ffn_hidden_size = 1024, 16, None, None
    config.resolve()
    assert (config.num_kv_heads, config.ffn_hidden_size) == (16, 2752)


def test_model_rejects_bad_inputs() -> None:
    model = GPTModel(tiny_config())
    tokens = torch.zeros(2, 8, dtype=torch.long)
    cases = [((tokens.float(),), {}, "tokens must be an integer tensor"),
             ((tokens[0],), {}, r"\[batch, local_seqlen\]"),
             ((tokens, torch.arange(7)), {}, r"position_ids must be integer \[batch, local_seqlen\] = \[2, 8\]"),
             ((tokens,), {"labels": tokens[:, :4]}, "labels must be an integer tensor shaped like tokens"),
             ((torch.zeros(1, 65, dtype=torch.long),), {}, "exceeds max_position_embeddings 64")]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(*args, **kwargs)
    assert model(torch.zeros(1, 7, dtype=torch.long)).shape == (1, 7, 128), "any length without CP, zigzag too"
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by num_kv_heads 3"):
        GPTModel(tiny_config(num_kv_heads=3))
    with pytest.raises(ValueError, match="unknown CP layout 'spiral'"):
        ModelParallel.build(layout="spiral")


def test_init_depends_only_on_seed_and_config() -> None:
    base = dict(GPTModel(tiny_config()).named_parameters())
    same = dict(GPTModel(tiny_config(mlp_chunks=4, activation_checkpointing=True),
                         ModelParallel.build(layout="stripe")).named_parameters())
    other = dict(GPTModel(tiny_config(seed=8)).named_parameters())
    assert base.keys() == same.keys() == other.keys()
    assert all(torch.equal(base[n], same[n]) for n in base)
    weights = [n for n in base if "norm" not in n]
    assert all(not torch.equal(base[n], other[n]) for n in weights)
    flat = [base[n].flatten() for n in weights]
    assert all(not torch.equal(a[:64], b[:64]) for i, a in enumerate(flat) for b in flat[i + 1:]), \
        "every parameter must get its own seed"
    assert base["lm_head.weight"].shape == (128, 32) and base["layers.0.attention.qkv.weight"].shape == (64, 32)
    tied = dict(GPTModel(tiny_config(tie_embeddings=True)).named_parameters())
    assert "lm_head.weight" not in tied and torch.equal(tied["embedding.weight"], base["embedding.weight"])


def test_rope_is_relative_and_starts_at_identity() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 2, 16, generator=gen), torch.randn(1, 1, 2, 16, generator=gen)

    def rotated(x: torch.Tensor, position: int) -> torch.Tensor:
        return apply_rope(x, *rope_tables(torch.tensor([[position]]), 16, 10000.0))

    scores = [(rotated(q, m) * rotated(k, m - 3)).sum(-1) for m in (3, 10, 500)]
    assert all(torch.allclose(s, scores[0], atol=1e-5) for s in scores)
    assert not torch.allclose((rotated(q, 10) * rotated(k, 3)).sum(-1), (q * k).sum(-1), atol=1e-3)
    assert torch.equal(rotated(q, 0), q)
    assert torch.allclose(rotated(q, 77).norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_attention_without_cp_is_the_local_kernel() -> None:
    """cp_group None: the model's attention is the local causal kernel (GQA), as SDPA computes it."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 24, 4, 8, generator=gen), *torch.randn(2, 2, 24, 2, 8, generator=gen)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    assert rel_err(context_parallel_attention(q, k, v, None), sdpa) < 1e-6


@pytest.mark.parametrize("overrides", [{"mlp_chunks": 2}, {"mlp_chunks": 4}, {"mlp_chunks": 5},
                                       {"activation_checkpointing": True},
                                       {"activation_checkpointing": True, "mlp_chunks": 4}])
def test_chunking_and_checkpointing_change_nothing(overrides) -> None:
    data = global_batch(tiny_config())
    ref = step(GPTModel(tiny_config()), data)
    got = step(GPTModel(tiny_config(**overrides)), data)
    assert rel_err(got["logits"], ref["logits"]) < 1e-6 and rel_err(got["losses"], ref["losses"]) < 1e-6
    errors = {n: rel_err(g, ref["grads"][n]) for n, g in got["grads"].items()}
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("checkpointing", [False, True])
def test_mlp_slices_run_twice_per_step(monkeypatch, checkpointing: bool) -> None:
    """mlp_chunks 4, one forward and backward of a 1-layer model: 8 slice forwards, the slices' own recompute
    or, inside a checkpointed block, the block's (nested checkpoints ran 11)."""
    calls = []
    original = MLP.local_mlp
    monkeypatch.setattr(MLP, "local_mlp", lambda self, x, *rest: calls.append(1) or original(self, x, *rest))
    model = GPTModel(tiny_config(num_layers=1, mlp_chunks=4, activation_checkpointing=checkpointing))
    data = global_batch(model.config)
    model(data["tokens"], labels=data["labels"]).sum().backward()
    assert len(calls) == 8, len(calls)


def test_chunked_mlp_keeps_only_its_input_for_backward() -> None:
    """Unchunked, the MLP saves its input, the weights and three [tokens, ffn] intermediates (the fused gate/up
    matmul's output, the product: ``model/mlp.py``'s ``swiglu``); chunked, only the input slices."""
    config = tiny_config(ffn_hidden_size=256)
    x = torch.randn(2, 64, 32, requires_grad=True)
    saved = {}
    for chunks in (1, 4):
        sizes: list[int] = []
        mlp = MLP(tiny_config(ffn_hidden_size=256, mlp_chunks=chunks), 0)

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(x)
        saved[chunks] = sum(sizes)
    input_bytes = x.numel() * x.element_size()
    assert saved[4] == input_bytes, saved
    weight_bytes = 3 * config.ffn_hidden_size * 32 * 4
    assert saved[1] == input_bytes + weight_bytes + 3 * 2 * 64 * config.ffn_hidden_size * 4, saved


def test_loss_is_per_token_cross_entropy_of_the_logits() -> None:
    model, data = GPTModel(tiny_config()), global_batch(tiny_config())
    losses = model(data["tokens"], labels=data["labels"])
    logits = model(data["tokens"])
    expected = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), reduction="none").view_as(losses)
    ignored = data["labels"] == -100
    assert losses.shape == (2, 32) and losses.dtype == torch.float32 and ignored.any()
    assert model.config.loss_chunk_tokens and not losses._is_view()  # a view: FSDP2 warns on every run
    assert torch.allclose(losses, expected, atol=1e-6) and torch.all(losses[ignored] == 0)
    positions = torch.arange(32)
    assert torch.equal(model(data["tokens"], positions), logits)
    assert torch.equal(model(data["tokens"], positions.expand(2, 32)), logits)
    shifted, stretched = model(data["tokens"], positions + 5), model(data["tokens"], positions * 2)
    assert rel_err(shifted, logits) < 1e-6, "RoPE only sees relative positions"
    assert rel_err(stretched, logits) > 1e-4  # ~1e-3 at init; the shift gives ~1e-7


def test_a_few_steps_fit_a_batch() -> None:
    torch.manual_seed(0)
    model, data = GPTModel(tiny_config(num_layers=1)), global_batch(tiny_config())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(data["tokens"], labels=data["labels"]).sum() / (data["labels"] != -100).sum()
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first, (first, loss.item())


def test_flops_count_matmul_weights_and_causal_attention() -> None:
    config = tiny_config()  # L=2, h=32, heads=4, kv=2, D=8, ffn=64, V=128
    n = 2 * (32 * (4 + 2 * 2) * 8 + 32 * 32 + 3 * 32 * 64) + 32 * 128
    assert matmul_params(config) == n == 22528
    model = GPTModel(config)
    weights = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name and "embedding" not in name)
    assert weights == n, "every matmul weight of the model is counted once"
    assert model_flops_per_token(config, 64) == 6 * n + 6 * 2 * 32 * 64
    assert model_flops_per_token(config, 64, causal=False) == 6 * n + 12 * 2 * 32 * 64
    tied = tiny_config(tie_embeddings=True)
    assert model_flops_per_token(tied, 64) == model_flops_per_token(config, 64)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        model_flops_per_token(config, 0)


def test_fsdp_does_not_search_the_cp_plan(monkeypatch) -> None:
    """FSDP2 searches each sharded block's arguments for tensors that need gradients, through dataclasses;
    the blocks get the RoPE tables and the plan (a dataclass of index tensors) in one object it leaves alone."""
    fsdp_utils = pytest.importorskip("torch.distributed.fsdp._common_utils")
    if not hasattr(fsdp_utils, "_collect_grad_tensors"):
        pytest.skip("this torch's FSDP2 searches arguments another way")
    from cp_train.model.block import BlockInputs
    from cp_train.parallel.cp.plan.batch_plan import _static_plan

    plan = _static_plan("ring", "zigzag", True, 8, 1, 0, 64)
    x = torch.randn(2, 8, requires_grad=True)
    cos, sin = torch.randn(2, 8, 1, 4), torch.randn(2, 8, 1, 4)
    visited: list[object] = []
    walk = fsdp_utils._collect_grad_tensors

    def counted(output, out, _depth=0):  # noqa: ANN001, ANN202
        visited.append(output)
        return walk(output, out, _depth)

    monkeypatch.setattr(fsdp_utils, "_collect_grad_tensors", counted)
    assert fsdp_utils.collect_grad_tensors(((x, BlockInputs(cos, sin, torch.tensor(1))), {})) == (x,)
    searched = len(visited)
    visited.clear()
    fsdp_utils.collect_grad_tensors(((x, cos, sin, plan), {}))  # the plan as an argument of its own
    assert searched <= 5 < len(visited), (searched, len(visited))
