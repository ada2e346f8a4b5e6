"""The model described once (``model/family.py``): what counts the model derives from its family's description of
the block, and agrees with the model itself.

- For Llama, Mistral (sliding windows), Qwen2 (q/k/v biases), Qwen3 (q/k norms, an explicit head_dim) and a model
  with attention sinks, ``model_flops_per_token`` x tokens equals what ``torch.utils.flop_counter`` counts over one
  forward + backward of the real model at cp 1 (the CP attention operator registers its formula), within 2%,
  and the family's parameter count equals the model's parameters.
- The planner's GEMMs are the family's linears, sharded over TP.
- A family registered from outside builds the model ``train.py`` trains (``model.family``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cp_train.model.config import ModelConfig
from cp_train.model.family import Llama, ModelFamily, get_model_family, model_flops_per_token, register_model_family

SEQ, BATCH = 128, 2
BASE = dict(vocab_size=256, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
            max_position_embeddings=SEQ, loss_chunk_tokens=0)  # full logits: the fused loss recomputes the head
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 32},
    "qwen2": {"qkv_bias": True, "num_kv_heads": 1},
    "qwen3": {"qk_norm": True, "head_dim": 32},
    "sinks": {"attention_sinks": True, "sliding_window": 48, "layer_types": ["sliding_attention", "full_attention"]},
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_model_flops_equal_the_flop_counter_and_the_parameters_the_model(name: str) -> None:
    config = ModelConfig(**{**BASE, **FAMILIES[name]})
    torch.manual_seed(0)
    model = get_model_family(config.family).build(config)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).sum().backward()
    counted = counter.get_total_flops()
    planned = model_flops_per_token(config, SEQ) * BATCH * SEQ
    assert counted == pytest.approx(planned, rel=0.02), (counted, planned)
    assert counter.get_flop_counts()["Global"][torch.ops.cp_train.attention] > 0  # attention is counted
    assert get_model_family("llama").parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_the_planners_gemms_are_the_familys_linears_sharded() -> None:
    from cp_train.config.schema import Config
    from cp_train.perf.workload import build_workload

    config = Config()
    config.model = ModelConfig(**{**BASE, "qkv_bias": True})
    config.data.seq_len, config.parallel.tp, config.parallel.dp = SEQ, 2, 1
    work = build_workload(config, 2, 2)
    linears = Llama().block_linears(config.model)
    assert [g.name for g in work.gemms] == [x.name for x in linears]
    for gemm, linear in zip(work.gemms, linears, strict=True):
        assert (gemm.k, gemm.n) == linear.shard(2) and gemm.m == SEQ and gemm.count == config.model.num_layers
    assert linears[0].shard(2) == (64, (4 + 2 * 2) * 16 // 2) and linears[1].shard(2) == (32, 64)


class Wider(Llama):
    """The Llama block under another family name (a family is one class and one registration)."""


def test_a_registered_family_builds_the_model_and_an_unknown_one_lists_the_families() -> None:
    family = register_model_family("wider", Wider())
    config = ModelConfig(**{**BASE, "family": "wider"})
    assert get_model_family("wider") is family and isinstance(family, ModelFamily)
    assert type(family.build(config)).__name__ == "GPTModel"
    with pytest.raises(ValueError, match="unknown model.family 'mamba'; choose one of llama, .*train.imports"):
        get_model_family("mamba")
