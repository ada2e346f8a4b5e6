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


def _documents(seq: int, cut: int) -> torch.Tensor:
    documents = torch.zeros(2, seq, dtype=torch.long)
    documents[:, cut:] = 1
    return documents


def test_compiled_step_matches_eager_without_host_syncs() -> None:
    """bf16 autocast, packed documents (plans built on the CPU and moved without blocking, as the loader does):
    the compiled model's losses and gradients equal the eager model's, three plans compile one graph per part,
    and a step under ``torch.cuda.set_sync_debug_mode("error")`` raises nothing (no device-to-host sync)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    config = tiny_config(**CONFIG)
    eager, compiled = GPTModel(config, device="cuda"), GPTModel(config, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_parts()
    tokens = torch.randint(0, config.vocab_size, (2, 257), device="cuda")

    def run(model: GPTModel, cut: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        plan = model.build_cp_plan(256, _documents(256, cut)).pin_memory().to("cuda", non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses = model(tokens[:, :-1], labels=tokens[:, 1:], plan=plan)
        losses.sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return losses.detach(), grads

    for cut in (100, 37, 200):
        (want, want_grads), (got, got_grads) = run(eager, cut), run(compiled, cut)
        assert rel_err(got, want) < 1e-2
        for name, grad in want_grads.items():
            assert rel_err(got_grads[name], grad) < 5e-2, name
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["stats"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(compiled, 150)
    finally:
        torch.cuda.set_sync_debug_mode("default")
