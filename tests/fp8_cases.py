"""Rank side of the FP8 training tests (``tests/train/test_fp8_train.py``): ``run_with_parallel((tp, cp, dp), fn,
...)`` on every rank of a spawned gloo world, on ``trainer_cases``' synthetic corpus.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from cp_train.parallel.mesh.state import ParallelState
from cp_train.parallel.tp.fp8 import fp8_all_gather_weights, fp8_layers
from cp_train.trainer import Trainer
from tests import trainer_cases

# cpu-tiny's model (launch/configs/cpu-tiny.yaml) on the synthetic corpus's vocabulary, at a short sequence
CPU_TINY_MODEL = {"model.num_layers": 4, "model.hidden_size": 192, "model.num_heads": 6, "model.num_kv_heads": 2,
                  "model.ffn_hidden_size": 512, "model.tie_embeddings": True}


def train_recipes(state: ParallelState, prefix: str, run_dir: str, recipes: list[str], overrides: dict[str, Any]
                  ) -> dict[str, Any]:
    """The tiny run (``trainer_cases.tiny_config`` with ``overrides``) once per ``model.fp8`` recipe on the same
    ranks: ``{recipe: {"losses": {step: loss}, "fp8_layers": [names of the layers computing in FP8]}}``."""
    out: dict[str, Any] = {}
    for recipe in recipes:
        config = trainer_cases.tiny_config(prefix, f"{run_dir}/{recipe}", state.dims,
                                           **{**overrides, "model.fp8": recipe})
        trainer = Trainer(config, state)
        out[recipe] = {"losses": trainer.train().losses, "fp8_layers": fp8_layers(trainer.model)}
    return out


def fsdp_fp8_state(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """One step of the tiny FSDP run with FP8: which weights FSDP gathers in FP8 and their local types."""
    trainer = Trainer(trainer_cases.tiny_config(prefix, run_dir, state.dims, **overrides), state)
    trainer.train(until_step=1)
    gathered = fp8_all_gather_weights(trainer.params)
    local = {type(w._local_tensor).__name__ for w in gathered}
    scales = [w._local_tensor._precomputed_scale for w in gathered]
    return {"gathered": len(gathered), "local_types": local, "dtensor": all(isinstance(w, DTensor) for w in gathered),
            "scales_set": all(isinstance(s, torch.Tensor) for s in scales),
            "fp8_linears": len(fp8_layers(trainer.model))}


def fsdp_fp8_gathers(state: ParallelState, prefix: str, run_dir: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The tiny FSDP run with FP8 (``overrides``): its losses, how many layers compute in FP8 and the names of the
    weights FSDP gathers in FP8."""
    trainer = Trainer(trainer_cases.tiny_config(prefix, run_dir, state.dims, **overrides), state)
    losses = trainer.train().losses
    gathered = {id(w) for w in fp8_all_gather_weights(trainer.params)}
    return {"losses": losses, "fp8_linears": len(fp8_layers(trainer.model)),
            "gathered": [name for name, p in trainer.model.named_parameters() if id(p) in gathered]}


def tp_collectives(state: ParallelState, prefix: str, run_dir: str, recipe: str) -> list[tuple[str, tuple, str]]:
    """The TP group's sequence-parallel collectives of one training step with ``model.fp8`` ``recipe``, in order:
    ``(name, shape, dtype)`` of each all-gather and reduce-scatter (``parallel/tp/sequence_parallel.py``)."""
    from cp_train.parallel.tp import sequence_parallel

    seen: list[tuple[str, tuple, str]] = []
    originals = {name: getattr(sequence_parallel, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def recorded(name: str) -> Any:
        def collective(output: torch.Tensor, tensor: torch.Tensor, group: Any = None, **kwargs: Any) -> Any:
            if group is state.tp.group:
                seen.append((name, tuple(tensor.shape), str(tensor.dtype)))
            return originals[name](output, tensor, group=group, **kwargs)
        return collective

    trainer = Trainer(trainer_cases.tiny_config(prefix, run_dir, state.dims, **{"model.fp8": recipe}), state)
    for name in originals:
        setattr(sequence_parallel, name, recorded(name))
    try:
        trainer.train_step(next(iter(trainer.loader)))
    finally:
        for name, fn in originals.items():
            setattr(sequence_parallel, name, fn)
    return seen


def error_without_torchao(state: ParallelState, prefix: str, run_dir: str) -> str:
    """The error a trainer with ``model.fp8`` tensorwise raises on a rank where torchao cannot be imported."""
    import sys

    from cp_train.errors import describe

    saved = sys.modules.get("torchao.float8")
    sys.modules["torchao.float8"] = None  # type: ignore[assignment]  # importing it raises ImportError
    try:
        Trainer(trainer_cases.tiny_config(prefix, run_dir, state.dims, **{"model.fp8": "tensorwise"}), state)
    except Exception as error:  # noqa: BLE001 - the test reads how it is reported
        return "{} (exit {})".format(*describe(error)[:2])
    finally:
        if saved is None:
            sys.modules.pop("torchao.float8", None)
        else:
            sys.modules["torchao.float8"] = saved
    return "no error"
