"""``model.meta.materialize``: what a meta-device build holds once materialised, on the CPU.

The contract any change of where the units are drawn must keep (issue 29: drawing them on the parameters'
device): every local parameter is filled, on the device it was allocated on, with bitwise the values of a
full build of the same seed, its TP shard being the slice of the full (tp = 1) weight along its partition
dimension, in every layout; the reference units are full-size, tp = 1 modules.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_train.model import GPTModel
from cp_train.model.meta import allocate, materialize, meta_model
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel
from tests.model_cases import tiny_config

CONFIG = {"num_layers": 3, "seed": 11}


def test_materialize_is_bitwise_the_full_build() -> None:
    config = tiny_config(**CONFIG)
    model = meta_model(config)
    assert all(p.is_meta for p in model.parameters())
    allocate(model, torch.device("cpu"))
    for param in model.parameters():  # garbage: materialize must overwrite every value
        param.data.fill_(float("nan"))
    materialize(model)
    full = dict(GPTModel(config).named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == full.keys() and len(got) > 3 * 4
    for name, param in got.items():
        assert param.device.type == "cpu" and param.dtype == full[name].dtype, name
        assert torch.equal(param, full[name]), name


def test_another_seed_draws_another_model() -> None:
    """Negative control: the comparison above is between seeded draws, not constants."""
    model = meta_model(tiny_config(**CONFIG))
    allocate(model, "cpu")
    materialize(model)
    other = dict(GPTModel(tiny_config(**{**CONFIG, "seed": 12})).named_parameters())
    drawn = [name for name, p in model.named_parameters() if p.dim() >= 2]
    assert drawn and not any(torch.equal(dict(model.named_parameters())[name], other[name]) for name in drawn)


def test_reference_units_are_full_size() -> None:
    config = tiny_config(**CONFIG)
    model = meta_model(config)
    full = dict(GPTModel(config).named_parameters())
    for prefix, unit in model.reference_units():
        for name, param in unit.named_parameters():
            assert param.shape == full[f"{prefix}.{name}"].shape and not param.is_meta, (prefix, name)


def _tp_shards(state: ParallelState) -> dict[str, Any]:
    """This rank's materialised local parameters, and the slices of the full build they must equal."""
    config = tiny_config(**CONFIG)
    model = meta_model(config, state.model_parallel("zigzag"))
    allocate(model, torch.device("cpu"))
    materialize(model)
    full = dict(GPTModel(config).named_parameters())
    out: dict[str, Any] = {"sharded": 0, "mismatched": []}
    for name, param in model.named_parameters():
        expected = full[name].detach()
        if getattr(param, "tensor_model_parallel", False):
            expected = expected.chunk(state.tp.size, dim=param.partition_dim)[state.tp.rank]
            out["sharded"] += 1
        if param.shape != expected.shape or not torch.equal(param.detach(), expected):
            out["mismatched"].append(name)
    return out


def test_tensor_parallel_shards_are_slices_of_the_full_build(spawn_world) -> None:
    for rank, answer in enumerate(spawn_world(2).run(run_with_parallel, (2, 1, 1), _tp_shards)):
        assert answer["sharded"] >= 4 * CONFIG["num_layers"] and not answer["mismatched"], (rank, answer)
