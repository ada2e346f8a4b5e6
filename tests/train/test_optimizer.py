"""Optimizer pieces: the LR schedule, weight-decay groups, clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cp_train.config.schema import OptimizerConfig, ScheduleConfig
from cp_train.optim import LRSchedule, build_optimizer, clip_gradients, global_grad_norm


def test_warmup_then_cosine_to_min_lr() -> None:
    schedule = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.1), ScheduleConfig(warmup_steps=4), train_steps=14)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == 1.0 and schedule(14) == pytest.approx(0.1) and schedule(100) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    linear = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.0), ScheduleConfig(decay="linear"), train_steps=10)
    assert linear(5) == pytest.approx(0.5)
    constant = LRSchedule(OptimizerConfig(lr=0.3), ScheduleConfig(warmup_steps=2, decay="constant"), 10)
    assert [constant(s) for s in (0, 1, 5)] == [0.15, 0.3, 0.3]


def test_adamw_groups_skip_decay_for_vectors() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and [p.dim() for p in decay["params"]] == [2]
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert optimizer.defaults["fused"] is True  # auto: torch's fused kernels on CPU as on CUDA
    foreach = build_optimizer(model, OptimizerConfig(implementation="foreach"), torch.device("cpu"))
    assert foreach.defaults["foreach"] is True and not foreach.defaults["fused"]


def test_global_norm_and_clipping_without_tp() -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.full((2, 2), 2.0)
    norm = global_grad_norm(params, None)
    assert float(norm) == pytest.approx(5.0)
    clip_gradients(params, 10.0, norm)  # below the limit: untouched
    assert float(params[0].grad[0]) == 3.0
    clip_gradients(params, 1.0, norm)
    assert float(global_grad_norm(params, None)) == pytest.approx(1.0, rel=1e-5)
