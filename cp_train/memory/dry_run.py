"""``train.py --dry-run``: every rank's memory, planned on the meta device before any process group or GPU.

For each rank of the configured layout the model is built on the meta device and cut to that rank's TP
and FSDP shards (FSDP2's shapes: ``torch.chunk`` pieces, the parameter and gradient storage padded to the
largest piece); the rank's AdamW steps once on meta gradients, creating its state on the meta device. The
bytes of these tensors are the rank's state, as the run's ``setup`` record measures it.

On top of the state, three moments of a step compete for the peak (``phases.py``: the head's backward, a
block's backward, the optimizer step), each with its transient copies ("gathered"), its activations
(``activations.py``) and the state's gradients the backward has not made yet.

``parallel.fsdp_reduce: auto`` is resolved on these plans by ``fsdp_reduce.py``, the same way by the dry run and
by the trainer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cp_train.config.schema import Config, ConfigError
from cp_train.config.validate import validate
from cp_train.data.default_corpus import DEFAULT_VOCAB_SIZE
from cp_train.data.tokenizers.load import load_tokenizer, padded_vocab_size
from cp_train.errors import launch_world_size
from cp_train.memory.activations import activation_estimate, shapes_of
from cp_train.memory.offload import offload_plan
from cp_train.memory.phases import phase_bytes
from cp_train.memory.state_bytes import optimizer_state_bytes
from cp_train.model.config import ModelConfig
from cp_train.model.meta import meta_model
from cp_train.model.parallelize import fsdp_shard_dim
from cp_train.model.shards import tensor_parallel_dim
from cp_train.optim import adamw_implementation
from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.parallel.mesh.rank_groups import ParallelDims

GIB = 2.0**30
RESERVE_GIB, RESERVE_FRACTION = 3.0, 0.05  # the default reserve: the CUDA context, NCCL, fragmentation


@dataclass(frozen=True)
class RankMemory:
    rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    gathered_bytes: int  # transient at the peak: gathered or cast parameters, unsharded gradients, temporaries
    activation_bytes: int  # at the peak
    phase: str = "head"  # the moment of the peak (``PHASES``)
    unmade_gradient_bytes: int = 0  # the state's gradients not made yet at the peak (``phases.gradients_made``)

    @property
    def state_bytes(self) -> int:
        """The state after a step (what the run's ``setup`` record measures)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def gradients_at_peak(self) -> int:
        return self.gradient_bytes - self.unmade_gradient_bytes

    @property
    def state_at_peak(self) -> int:
        """The state less the gradients not made yet at the peak."""
        return self.state_bytes - self.unmade_gradient_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_at_peak + self.gathered_bytes + self.activation_bytes


def reserve_gib(device_gib: float, fixed: float = RESERVE_GIB, fraction: float = RESERVE_FRACTION) -> float:
    """GiB per device kept back for the runtime (CUDA context, NCCL's buffers) and allocator fragmentation."""
    return fixed + fraction * device_gib


def checked_reserve_gib(device_gib: float, fixed: float, fraction: float, device: str) -> float:
    """``reserve_gib`` of ``device``'s ``device_gib`` GiB; ConfigError, in the flags' words, when it keeps all of
    them (a command adds its own hint)."""
    reserve = reserve_gib(device_gib, fixed, fraction)
    if reserve >= device_gib:
        raise ConfigError(f"--reserve-gib {fixed:g} + --reserve-fraction {fraction:g} of the {device_gib:g} GiB of "
                          f"{device} keep {reserve:.3g} GiB, all of its memory: lower them")
    return reserve


def local_shapes(full: torch.nn.Parameter, dims: ParallelDims, rank: int, fsdp: bool, replicas: int = 1
                 ) -> tuple[torch.Size, torch.Size]:
    """``(held, stored)`` shapes of ``rank``'s shard of the full parameter ``full`` (a meta parameter with the TP
    attributes): its TP chunk, then with FSDP its chunk over DP x CP, or under HSDP over a replica's DP x CP of
    ``replicas`` (``stored``: padded to the largest)."""
    coordinates = dims.coordinates(rank)
    shape = list(full.shape)
    tp_dim = tensor_parallel_dim(full)
    if tp_dim is not None:
        shape[tp_dim] //= dims.tp
    if not fsdp:
        return torch.Size(shape), torch.Size(shape)
    dim, parts = fsdp_shard_dim(full, dims.tp), dims.data // replicas
    index = coordinates["cp"] + dims.cp * (coordinates["dp"] % (dims.dp // replicas))
    chunk = -(-shape[dim] // parts)
    held, stored = list(shape), list(shape)
    held[dim], stored[dim] = max(0, min(chunk, shape[dim] - index * chunk)), chunk
    return torch.Size(held), torch.Size(stored)


_STATE: dict[tuple, tuple[int, int, int]] = {}  # rank_state by (model, layout, rank, fsdp, optimizer)
_META: dict[str, dict[str, torch.nn.Parameter]] = {}  # meta parameters by model


def _model_key(model: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)


def _meta_parameters(model: ModelConfig) -> dict[str, torch.nn.Parameter]:
    """The full model's named parameters on the meta device (built once per model: shapes only)."""
    key = _model_key(model)
    if key not in _META:
        _META[key] = dict(meta_model(model).named_parameters())
    return _META[key]


def rank_state(config: Config, full: dict[str, torch.nn.Parameter], dims: ParallelDims, rank: int
               ) -> tuple[int, int, int]:
    """``(parameter, gradient, optimizer)`` bytes of ``rank``, from the shapes of its shards (fp32 parameters)."""
    fsdp = config.parallel.fsdp
    held, stored = [], []
    for param in full.values():
        shape, padded = local_shapes(param, dims, rank, fsdp, config.parallel.dp_replicate)
        held.append(shape)
        stored.append(padded.numel() * 4)
    return sum(stored), sum(stored), optimizer_state_bytes(config.optimizer, held)


def dry_run_vocab(config: Config) -> int:
    """``model.vocab_size``, else the one training would take from the tokenizer (padded to a multiple of 128):
    the embedded corpus's, or ``data.tokenizer``'s when that file is on this machine."""
    if config.model.vocab_size is not None:
        return config.model.vocab_size
    tokenizer = config.data.tokenizer
    if tokenizer is None and config.data.prefix is None:
        return padded_vocab_size(DEFAULT_VOCAB_SIZE)
    if tokenizer is not None and Path(tokenizer).exists():
        try:
            return padded_vocab_size(load_tokenizer(tokenizer).vocab_size)
        except (OSError, ValueError) as error:
            raise ConfigError(f"data.tokenizer {tokenizer}: {error}") from None
    where = f"data.tokenizer {tokenizer} is not on this machine" if tokenizer else "data.prefix has no data.tokenizer"
    raise ConfigError(f"the dry run needs model.vocab_size ({where}): set it to the tokenizer's size, e.g. "
                      f"--set model.vocab_size=128256 for Llama 3")


def with_vocab(config: Config) -> Config:
    """``config`` with ``model.vocab_size`` the one training would take (``dry_run_vocab``), a new config when it
    was unset."""
    if config.model.vocab_size is not None:
        return config
    return replace(config, model=replace(config.model, vocab_size=dry_run_vocab(config)))


def memory_plan(config: Config, world: int, only: list[int] | None = None, fp8_keeps: str | None = None
                ) -> tuple[ParallelDims, list[RankMemory], dict[str, int], dict[str, Any]]:
    """Every rank's memory (or the ranks ``only``) for ``config`` on ``world`` ranks: the layout, per rank
    figures, the activation estimate's terms and the assumptions (device, dtypes, tokens). ``config`` is not
    changed. ``fp8_keeps``: what another framework's FP8 linears keep (``activations.shapes_of``); given, its blocks
    are planned as eager ones whatever ``train.compile`` (what a compiled block keeps is Inductor's partition of
    this trainer's block)."""
    config = with_vocab(config)
    dp = validate(config, world)
    parallel = config.parallel
    dims = ParallelDims(tp=parallel.tp, cp=parallel.cp, dp=dp)
    cuda = parallel.backend != "gloo"
    bf16 = config.train.dtype == "bf16" or (config.train.dtype == "auto" and cuda)
    compute = 2 if bf16 else 4
    fsdp = parallel.fsdp
    tokens = config.train.micro_batch_size * config.data.seq_len // dims.cp
    accumulation = config.train.global_batch_size // (config.train.micro_batch_size * dp)
    shapes = shapes_of(config.model, tokens, dims.tp, dims.cp, compute, compute if fsdp else 4,
                       get_cp_algorithm(parallel.cp_algorithm), parallel.ulysses_size,
                       parallel.sequence_parallel_on, cuda=cuda, compiled=config.train.compile and fp8_keeps is None,
                       fp8_keeps=fp8_keeps)
    activations = activation_estimate(config.model, shapes)
    optimizer = config.optimizer
    foreach = adamw_implementation(optimizer, "cuda" if cuda else "cpu") == "foreach"  # apex: neither torch kernel
    full = _meta_parameters(config.model)
    ranks = []
    for rank in range(dims.world) if only is None else only:
        key = (_model_key(config.model), dims, rank, config.parallel.fsdp, config.parallel.dp_replicate,
               repr(config.optimizer))
        if key not in _STATE:  # the planner asks for the same state under many activation settings
            _STATE[key] = rank_state(config, full, dims, rank)
        params, grads, moments = _STATE[key]
        phases = phase_bytes(config, full, dims, compute, accumulation, activations, (params, grads), foreach,
                             shapes.fp8_inputs)
        phase = max(phases, key=lambda name: phases[name][0] + phases[name][1] - phases[name][2])
        gathered, activation, unmade = phases[phase]
        ranks.append(RankMemory(rank, params, grads, moments, gathered, activation, phase, unmade))
    assumed = {"device": "cuda" if cuda else "cpu", "compute": "bf16" if bf16 else "fp32", "tokens_per_rank": tokens,
               "accumulation": accumulation, "parameters": sum(p.numel() for p in full.values()),
               "sequence_parallel": shapes.sequence_parallel, "algorithm": shapes.algorithm,
               "offload": offload_plan(config.model, shapes, activations["block"])}
    return dims, ranks, activations, assumed


def sig3(value: float) -> str:
    """``value`` with three significant figures (``0.00123``, ``0.250``, ``4.00``, ``30.5``, ``123``)."""
    if value == 0:
        return "0"
    return f"{value:.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"


def dry_run_world(config: Config) -> int:
    """The world size to plan for: torchrun's ``WORLD_SIZE``, else tp x cp x (dp or 1)."""
    if "WORLD_SIZE" in os.environ:
        return launch_world_size()
    return math.prod((config.parallel.tp, config.parallel.cp, config.parallel.dp or 1))
