"""The GPT model at cp=1 on CUDA (fp32 and bf16 autocast) against the same model in float64 on the CPU."""

from __future__ import annotations

import pytest
import torch

from cp_train.model import GPTModel
from tests.model_cases import global_batch, step, tiny_config
from tests.numerics import rel_err

# head_dim 16: the flash kernels' multiple of 8, and efficient attention's
CONFIG = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128, "max_position_embeddings": 256}


@pytest.mark.parametrize("autocast", [False, True])
def test_model_on_cuda_matches_cpu_float64(autocast: bool) -> None:
    config = tiny_config(**CONFIG)
    data = global_batch(config, seq=256)
    reference = step(GPTModel(config, dtype=torch.float64), data)
    model = GPTModel(config, device="cuda")
    cuda_data = {name: x.cuda() for name, x in data.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got = step(model, cuda_data)
    tol_logits, tol_grads = (3e-2, 8e-2) if autocast else (2e-5, 2e-4)
    assert rel_err(got["logits"].float().cpu(), reference["logits"]) < tol_logits
    assert rel_err(got["losses"].cpu(), reference["losses"]) < tol_logits
    for name, grad in reference["grads"].items():
        assert rel_err(got["grads"][name].cpu(), grad) < tol_grads, name
