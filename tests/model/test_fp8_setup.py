"""``model.fp8``'s setup (``parallel/tp/fp8.py``): the one-line errors (no torchao, a GPU before sm_89, an unknown
recipe), what converts and which weights FSDP gathers in FP8, the planner's switch and the resume note."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from cp_train.checkpoint.resume import check_resume
from cp_train.cli.plan import base_config
from cp_train.config.schema import ConfigError
from cp_train.config.sources import build_config
from cp_train.config.validate import validate
from cp_train.model import GPTModel
from cp_train.parallel.tp.fp8 import convert_to_fp8, fp8_layers, fp8_unavailable
from cp_train.perf.rates import linear_precision
from tests.model_cases import tiny_config

CPU = torch.device("cpu")
if fp8_unavailable("tensorwise", CPU):  # the dev extra installs torchao
    pytest.skip(fp8_unavailable("tensorwise", CPU), allow_module_level=True)
BLOCK_LINEARS = ("attention.qkv", "attention.proj", "mlp.gate_up", "mlp.down")


# ----------------------------------------------------------------------------------------------- errors
def test_without_torchao_the_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 raises ImportError
    message = fp8_unavailable("tensorwise", CPU)
    assert message is not None and "\n" not in message
    assert message.startswith("model.fp8 tensorwise needs torchao's float8 training")
    assert 'pip install -e ".[fp8]"' in message and "model.fp8=none" in message
    assert fp8_unavailable("none", CPU) is None


def test_a_gpu_before_sm89_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    message = fp8_unavailable("rowwise", cuda)
    assert message == ("model.fp8 rowwise needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                       "Blackwell) and NVIDIA A100-SXM4-80GB is sm_80: set model.fp8=none")
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_unavailable("tensorwise", cuda) is None, capability


def test_converting_takes_any_shape_and_applies_torchaos_inductor_patch(monkeypatch) -> None:
    """``convert_to_fp8`` converts any shape (the GPU's multiples of 16 are the config's check:
    ``tests/config/test_fp8_shapes.py``) and applies torchao's Triton workaround once per conversion, as
    ``convert_to_float8_training`` does; nothing for ``none``."""
    import torchao.float8._inductor_patch as patch

    calls: list[int] = []
    monkeypatch.setattr(patch, "_patch_inductor_min_max_codegen", lambda: calls.append(1))
    odd = {"hidden_size": 40, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64}  # qkv [80, 40]
    assert len(convert_to_fp8(GPTModel(tiny_config(**odd)).layers, "tensorwise", CPU)) == 8  # 2 layers x 4 linears
    assert calls == [1]
    assert convert_to_fp8(GPTModel(tiny_config()).layers, "none", CPU) == [] and calls == [1]


def test_fsdp_gathers_in_fp8_only_the_weights_that_split_evenly() -> None:
    """torchao 0.18 hands FSDP2 an unpadded shard: at 3 FSDP ranks the [256, 48] gate/up weight (hidden 48, ffn 128)
    keeps its plain parameter (gathered in the compute dtype), qkv [96, 48], out [48, 48] and down [48, 128] get the
    FP8 wrapper; at 2 ranks all four; every layer multiplies in FP8 either way. Under FSDP the weight is not cast
    before torchao's matmul: it keeps the gathered weight, which FSDP frees after the forward and gathers again."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapper

    config = {"hidden_size": 48, "ffn_hidden_size": 128}
    wrapped = {}
    for shards in (3, 2, 0):
        model = GPTModel(tiny_config(**config))
        assert len(convert_to_fp8(model.layers, "tensorwise", CPU, fsdp_shards=shards, prefix="layers.")) == 8
        assert len(fp8_layers(model)) == 8
        # under FSDP the weight is cast per GEMM from the gathered one (kept in FP8 it would outlive FSDP's reshard)
        assert model.layers[1].mlp.down.linear_fn.cast_once == (True, shards == 0)
        wrapped[shards] = [name for name in BLOCK_LINEARS
                           if isinstance(model.layers[1].get_submodule(name).weight, Wrapper)]
    assert wrapped == {3: ["attention.qkv", "attention.proj", "mlp.down"], 2: list(BLOCK_LINEARS), 0: []}


def test_an_unknown_recipe_is_a_config_error() -> None:
    config = build_config([("test", {"model.fp8": "fp16", "model.vocab_size": 128, "data.eod_id": 0})])
    with pytest.raises(ConfigError, match=r"^model.fp8 must be one of none, tensorwise, rowwise; got 'fp16'$"):
        validate(config, 1)
    config = build_config([("test", {"model.fp8": "tensorwise", "model.fp8_fast_accum": "some",
                                     "model.vocab_size": 128, "data.eod_id": 0})])
    with pytest.raises(ConfigError, match=r"^model.fp8_fast_accum must be one of output, all, none; got 'some'$"):
        validate(config, 1)


# ----------------------------------------------------------------------------------------------- planner, resume
def _plan_args(model: str, precision: str | None) -> argparse.Namespace:
    return argparse.Namespace(model=model, vocab_size=128256, seq_len=8192, gpus=8, global_batch_tokens=None,
                              eager=False, precision=precision)


def test_the_planners_precision_is_model_fp8(tmp_path) -> None:
    """One switch: a config with model.fp8 plans FP8 linears unless --precision bf16 says otherwise, and
    --precision fp8 plans a bf16 config (or a preset) with tensorwise."""
    yaml = tmp_path / "fp8.yaml"
    yaml.write_text("model:\n  vocab_size: 32000\n  num_layers: 2\n  hidden_size: 256\n  num_heads: 4\n"
                    "  fp8: rowwise\n")
    cases = {(str(yaml), None): "rowwise", (str(yaml), "bf16"): "none", (str(yaml), "fp8"): "rowwise",
             ("llama3-8b", None): "none", ("llama3-8b", "fp8"): "tensorwise", ("llama3-8b", "bf16"): "none"}
    for (model, precision), fp8 in cases.items():
        assert base_config(_plan_args(model, precision)).model.fp8 == fp8, (model, precision)
    assert [linear_precision(r) for r in ("none", "tensorwise", "rowwise")] == ["bf16", "fp8", "fp8"]


def test_a_resume_that_switches_fp8_is_one_note() -> None:
    saved = build_config([("saved", {"model.vocab_size": 128})]).to_dict()
    config = build_config([("now", {"model.vocab_size": 128, "model.fp8": "tensorwise"})])
    notes = check_resume(saved, config, "ckpt")
    assert notes == ["model.fp8 none -> tensorwise: the checkpoint's weights and optimizer state load as saved (FP8 "
                     "changes how the blocks' linears compute, not the fp32 weights they keep)"]
