"""apex behind ``model.norm`` and ``optimizer.implementation``, with stand-in modules (apex cannot be built here).

The stand-ins copy apex's signatures: ``apex.normalization.FusedRMSNorm(normalized_shape, eps, elementwise_affine,
memory_efficient)`` with apex's own off-CUDA body (``manual_rms_norm``), and ``apex.optimizers.FusedAdam(params, lr,
bias_correction, betas, eps, adam_w_mode, weight_decay, ...)`` computing torch's AdamW. They are put into
``sys.modules`` by monkeypatch. An explicit ``apex`` uses apex's module on any device (real apex falls back to its
Python RMSNorm off CUDA), which is what makes it testable on the CPU; ``auto`` takes apex only for a CUDA build, faked
here as a meta-device build with ``torch.cuda.is_available`` patched to True.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from cp_train.config.schema import OptimizerConfig
from cp_train.errors import InputError
from cp_train.model.block import rms_norm
from cp_train.model.gpt import GPTModel
from cp_train.model.meta import allocate, materialize, meta_model
from cp_train.optim import build_optimizer
from tests.model_cases import global_batch, tiny_config


class FusedRMSNorm(nn.Module):
    """apex's signature, parameter and CPU fallback (``apex.normalization.fused_layer_norm.manual_rms_norm``)."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.weight = nn.Parameter(torch.empty(*self.normalized_shape))
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-1, -len(self.normalized_shape) - 1, -1))
        variance = x.to(torch.float32).pow(2).mean(dims, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class FusedAdam(torch.optim.AdamW):
    """apex's signature; records each call's keyword arguments in ``CALLS``."""

    CALLS: list[dict[str, Any]] = []

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False) -> None:
        FusedAdam.CALLS.append({"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                "adam_w_mode": adam_w_mode, "weight_decay": weight_decay})
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)


@pytest.fixture
def apex(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in ``apex`` package with ``normalization`` and ``optimizers``."""
    package = types.ModuleType("apex")
    normalization, optimizers = types.ModuleType("apex.normalization"), types.ModuleType("apex.optimizers")
    normalization.FusedRMSNorm, optimizers.FusedAdam = FusedRMSNorm, FusedAdam
    package.normalization, package.optimizers = normalization, optimizers
    for name, module in (("apex", package), ("apex.normalization", normalization), ("apex.optimizers", optimizers)):
        monkeypatch.setitem(sys.modules, name, module)
    FusedAdam.CALLS.clear()
    return package


@pytest.fixture
def no_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    """apex cannot be imported (whatever is installed)."""
    for name in ("apex", "apex.normalization", "apex.optimizers"):
        monkeypatch.setitem(sys.modules, name, None)


def norms(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("norm")]


def test_auto_on_cpu_is_torchs_norm(apex) -> None:
    model = GPTModel(tiny_config())
    assert len(norms(model)) == 5 and all(type(m) is nn.RMSNorm for m in norms(model))
    assert type(rms_norm(8, 1e-5, "auto", device="cpu")) is nn.RMSNorm
    with torch.device("meta"):  # a meta build on a machine without CUDA
        assert type(rms_norm(8, 1e-5, "auto")) is nn.RMSNorm


def test_auto_takes_apex_for_a_cuda_build(apex, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = meta_model(tiny_config())
    assert all(type(m) is FusedRMSNorm and m.weight.is_meta for m in norms(model))
    assert type(rms_norm(8, 1e-5, "torch", device="meta")) is nn.RMSNorm


def test_auto_falls_back_silently_without_apex(no_apex, monkeypatch, recwarn) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = meta_model(tiny_config())
    assert all(type(m) is nn.RMSNorm for m in norms(model)) and not recwarn.list


def test_apex_norm_computes_torchs_with_the_same_state_dict(apex) -> None:
    torch_model, apex_model = GPTModel(tiny_config(norm="torch")), GPTModel(tiny_config(norm="apex"))
    assert len(norms(apex_model)) == 5 and all(type(m) is FusedRMSNorm for m in norms(apex_model))
    assert list(torch_model.state_dict()) == list(apex_model.state_dict())
    for module in norms(torch_model):
        module.weight.data.uniform_(0.5, 1.5)  # not ones, so that the weights matter
    apex_model.load_state_dict(torch_model.state_dict())
    data = global_batch(torch_model.config)
    with torch.no_grad():
        want, got = torch_model(data["tokens"]), apex_model(data["tokens"])
    assert (got - want).abs().max().item() < 1e-6
    x = torch.randn(3, 5, 16)
    norm, fused = rms_norm(16, 1e-5, "torch"), rms_norm(16, 1e-5, "apex", dtype=torch.float64)
    assert fused.weight.dtype == torch.float64
    assert torch.allclose(fused.float()(x), norm(x), atol=1e-6, rtol=0)


def test_meta_build_with_apex_norm_materialises_the_seeded_model(apex) -> None:
    config = tiny_config(norm="apex")
    model = meta_model(config)
    allocate(model, "cpu")
    materialize(model)
    full = GPTModel(config)
    assert all(torch.equal(p, full.state_dict()[name]) for name, p in model.state_dict().items())


def test_apex_norm_missing_says_what_to_change(no_apex) -> None:
    with pytest.raises(ImportError, match=r"^model.norm is apex but apex's FusedRMSNorm cannot be loaded "
                                          r"\(.*\); install NVIDIA apex .* or set model.norm to auto or torch$"):
        GPTModel(tiny_config(norm="apex"))
    with pytest.raises(ValueError, match=r"unknown norm 'fused'; choose one of auto, torch, apex"):
        tiny_config(norm="fused").validate()


def test_optimizer_impl_apex_builds_fused_adam(apex) -> None:
    model = GPTModel(tiny_config())
    config = OptimizerConfig(lr=1e-3, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.05, implementation="apex")
    optimizer = build_optimizer(model, config, torch.device("cpu"))
    assert type(optimizer) is FusedAdam
    assert FusedAdam.CALLS == [{"lr": 1e-3, "bias_correction": True, "betas": (0.8, 0.9), "eps": 1e-7,
                                "adam_w_mode": True, "weight_decay": 0.0}]
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    planned = build_optimizer(model, config, torch.device("meta"))  # the dry run: torch's AdamW stands in
    assert type(planned) is torch.optim.AdamW


def test_optimizer_auto_is_torchs_adamw(apex) -> None:
    optimizer = build_optimizer(GPTModel(tiny_config()), OptimizerConfig(implementation="auto"), torch.device("cpu"))
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] and not optimizer.defaults["foreach"]
    assert not FusedAdam.CALLS


def test_optimizer_apex_missing_says_what_to_change(no_apex, monkeypatch) -> None:
    model, config = GPTModel(tiny_config()), OptimizerConfig(implementation="apex")
    message = r"^optimizer.implementation is apex but apex's FusedAdam cannot be loaded \((?P<why>.*)\); install NVIDIA"
    with pytest.raises(InputError, match=message + r".* or set optimizer.implementation to auto$"):
        build_optimizer(model, config, torch.device("cpu"))

    def no_extensions(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("apex.optimizers.FusedAdam requires cuda extensions")

    monkeypatch.setitem(sys.modules, "apex.optimizers", types.SimpleNamespace(FusedAdam=no_extensions))
    with pytest.raises(InputError, match=r"cannot be loaded \(apex.optimizers.FusedAdam requires cuda extensions\)"):
        build_optimizer(model, config, torch.device("cpu"))
