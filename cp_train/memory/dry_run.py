"""``train.py --dry-run``: every rank's memory, planned on the meta device before any process group or GPU.

For each rank of the configured layout the model is built on the meta device and cut to that rank's TP
and FSDP shards (FSDP2's shapes: ``torch.chunk`` pieces, the parameter and gradient storage padded to the
largest piece); the rank's AdamW steps once on meta gradients, creating its state on the meta device. The
bytes of these tensors are the rank's state, as the run's ``setup`` record measures it. On top come the
transient copies: the parameters FSDP gathers in the compute dtype (the root's and the last block's, the
current block and the prefetched one; every block without resharding after forward) or the bf16 weights
autocast caches without FSDP; the unsharded fp32 gradients (the root's until the end of the backward and
one block's; every parameter's while gradients accumulate over micro-batches, as nothing is reduced
before the last, unless ``parallel.fsdp_reduce`` is per_microbatch); and the activation estimate of
``activations.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from cp_train.config.schema import Config, ConfigError
from cp_train.config.validate import validate
from cp_train.data.default_corpus import DEFAULT_VOCAB_SIZE
from cp_train.data.tokenizers.load import load_tokenizer, padded_vocab_size
from cp_train.memory.activations import activation_estimate
from cp_train.model.meta import meta_model
from cp_train.model.parallelize import fsdp_shard_dim
from cp_train.model.shards import tensor_parallel_dim
from cp_train.optim import build_optimizer
from cp_train.parallel.mesh.rank_groups import ParallelDims

GIB = 2.0**30


@dataclass(frozen=True)
class RankMemory:
    rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    gathered_bytes: int  # transient: gathered or cast parameters, unsharded gradients
    activation_bytes: int

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.gathered_bytes + self.activation_bytes


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def local_shapes(full: torch.nn.Parameter, dims: ParallelDims, rank: int, fsdp: bool
                 ) -> tuple[torch.Size, torch.Size]:
    """``(held, stored)`` shapes of ``rank``'s shard of the full parameter ``full`` (a meta parameter with the TP
    attributes): its TP chunk, then with FSDP its chunk over DP x CP (``stored``: padded to the largest)."""
    coordinates = dims.coordinates(rank)
    shape = list(full.shape)
    tp_dim = tensor_parallel_dim(full)
    if tp_dim is not None:
        shape[tp_dim] //= dims.tp
    if not fsdp:
        return torch.Size(shape), torch.Size(shape)
    dim, parts = fsdp_shard_dim(full, dims.tp), dims.data
    index = coordinates["cp"] + dims.cp * coordinates["dp"]
    chunk = -(-shape[dim] // parts)
    held, stored = list(shape), list(shape)
    held[dim], stored[dim] = max(0, min(chunk, shape[dim] - index * chunk)), chunk
    return torch.Size(held), torch.Size(stored)


def rank_state(config: Config, full: dict[str, torch.nn.Parameter], dims: ParallelDims, rank: int
               ) -> tuple[int, int, int]:
    """``(parameter, gradient, optimizer)`` bytes of ``rank``, from meta tensors of its shapes."""
    fsdp = config.parallel.fsdp
    held, stored = [], []
    for param in full.values():
        shape, padded = local_shapes(param, dims, rank, fsdp)
        held.append(torch.nn.Parameter(torch.empty(shape, device="meta")))
        stored.append(torch.empty(padded, device="meta"))
    module = torch.nn.ParameterList(held)
    for param in held:
        param.grad = torch.empty_like(param)
    optimizer = build_optimizer(module, replace(config.optimizer, implementation="foreach"),
                                torch.device("meta"))  # the same state as fused, which meta tensors refuse
    optimizer.step()  # AdamW creates its state (on the meta device, the step counts on the CPU)
    moments = [value for entry in optimizer.state.values() for value in entry.values() if torch.is_tensor(value)]
    return _nbytes(stored), _nbytes(stored), _nbytes(moments)


def transient_bytes(config: Config, full: dict[str, torch.nn.Parameter], dims: ParallelDims, compute: int,
                    accumulation: int) -> int:
    """Gathered or cast parameters and unsharded gradients one rank holds at most at once (see the module doc)."""
    tp_local = {name: p.numel() // (dims.tp if tensor_parallel_dim(p) is not None else 1) for name, p in full.items()}
    layers = config.model.num_layers
    blocks = [sum(n for name, n in tp_local.items() if name.startswith(f"layers.{i}.")) for i in range(layers)]
    root = sum(n for name, n in tp_local.items() if not name.startswith("layers."))
    if not config.parallel.fsdp:
        return compute * sum(tp_local.values()) if compute == 2 else 0  # autocast's cache of bf16 weights
    gathered = root + (sum(blocks) if not config.parallel.fsdp_reshard_after_forward else 3 * max(blocks))
    every_parameter = accumulation > 1 and config.parallel.fsdp_reduce == "per_step"
    unsharded_grads = sum(tp_local.values()) if every_parameter else root + max(blocks)
    return compute * gathered + 4 * unsharded_grads


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


def plan(config: Config, world: int) -> tuple[ParallelDims, list[RankMemory], dict[str, int], dict[str, object]]:
    """Every rank's memory for ``config`` on ``world`` ranks: the layout, per rank figures, the activation
    estimate's terms and the assumptions (device, dtypes, tokens)."""
    config.model.vocab_size = dry_run_vocab(config)
    dp = validate(config, world)
    dims = ParallelDims(tp=config.parallel.tp, cp=config.parallel.cp, dp=dp)
    cuda = config.parallel.backend != "gloo"
    bf16 = config.train.dtype == "bf16" or (config.train.dtype == "auto" and cuda)
    compute = 2 if bf16 else 4
    fsdp = config.parallel.fsdp
    tokens = config.train.micro_batch_size * config.data.seq_len // dims.cp
    accumulation = config.train.global_batch_size // (config.train.micro_batch_size * dp)
    activations = activation_estimate(config.model, tokens, dims.tp, dims.cp, compute,
                                      residual=compute if fsdp else 4, autocast=bf16 and not fsdp)
    full = dict(meta_model(config.model).named_parameters())
    transient = transient_bytes(config, full, dims, compute, accumulation)
    ranks = []
    for rank in range(dims.world):
        params, grads, moments = rank_state(config, full, dims, rank)
        ranks.append(RankMemory(rank, params, grads, moments, transient, activations["peak"]))
    assumed = {"device": "cuda" if cuda else "cpu", "compute": "bf16" if bf16 else "fp32", "tokens_per_rank": tokens,
               "accumulation": accumulation, "parameters": sum(p.numel() for p in full.values())}
    return dims, ranks, activations, assumed


class DryRunReport(NamedTuple):
    text: str
    fits: bool  # the largest rank's total within the device memory


def sig3(value: float) -> str:
    """``value`` with three significant figures (``0.00123``, ``0.250``, ``4.00``, ``30.5``, ``123``)."""
    if value == 0:
        return "0"
    return f"{value:.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"


def report(config: Config, world: int, device_gib: float, source: str = "the config",
           reserve_gib: float = 0.0) -> DryRunReport:
    """The dry run's text (the layout and assumptions, the activation terms, one line per rank, the reserve, the
    verdict and, when the largest rank does not fit, what to change) and whether it fits: the largest rank
    within ``device_gib`` less ``reserve_gib`` (the CUDA context, NCCL's buffers, allocator fragmentation)."""
    dims, ranks, activations, assumed = plan(config, world)
    parallel, model = config.parallel, config.model
    mode = (f"FSDP over dp x cp ({'ZeRO-3' if parallel.fsdp_reshard_after_forward else 'ZeRO-2'})"
            if parallel.fsdp else "DDP (replicated parameters)")
    lines = [f"dry run of {source}: {assumed['parameters']:,} parameters, world {dims.world} = tp {dims.tp} x cp "
             f"{dims.cp} x dp {dims.dp}, {mode}, {assumed['compute']} compute on {assumed['device']}"
             f"{' (--set parallel.backend=gloo: CPU)' if assumed['device'] == 'cuda' else ''}, "
             f"{assumed['tokens_per_rank']:,} tokens per rank per micro-batch, "
             f"{assumed['accumulation']} micro-batch(es) per step",
             f"activations per rank (estimate): blocks {sig3(activations['blocks'] / GIB)} GiB ({model.num_layers} "
             f"blocks, activation checkpointing {model.activation_checkpointing}, mlp_chunks "
             f"{model.mlp_chunks}), head and loss {sig3(activations['head'] / GIB)} GiB, backward working set "
             f"{sig3(activations['backward'] / GIB)} GiB: peak {sig3(activations['peak'] / GIB)} GiB"]
    header = ("rank", "parameters", "gradients", "optimizer", "state", "gathered", "activations", "total")
    rows = [header] + [(str(r.rank), *(sig3(b / GIB) for b in (
        r.parameter_bytes, r.gradient_bytes, r.optimizer_bytes, r.state_bytes, r.gathered_bytes,
        r.activation_bytes, r.total_bytes))) for r in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("GiB per rank:")
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    worst = max(ranks, key=lambda r: r.total_bytes)
    usable = device_gib - reserve_gib
    fits = worst.total_bytes <= usable * GIB
    lines.append(f"reserve: {sig3(reserve_gib)} GiB per device for the runtime (CUDA context, NCCL) and fragmentation "
                 f"(--reserve-gib, --reserve-fraction): {sig3(usable)} of {device_gib:g} GiB usable")
    lines.append(f"{'fits' if fits else 'does NOT fit'}: the largest rank ({worst.rank}) needs "
                 f"{sig3(worst.total_bytes / GIB)} GiB of {sig3(usable)} GiB usable per device "
                 f"({100 * worst.total_bytes / (usable * GIB):.0f}%)")
    if not fits:
        lines.append(f"to fit: {shrink_hint(config, worst)}")
    return DryRunReport("\n".join(lines), fits)


def shrink_hint(config: Config, worst: RankMemory) -> str:
    """What to change, the largest part first: the state (sharding) or the activations (tokens per rank)."""
    model, parallel = config.model, config.parallel
    if not parallel.fsdp:
        state = ["--fsdp (shards parameters, gradients and optimizer state over dp x cp)",
                 "a larger parallel.tp (splits the weights)"]
    else:
        state = ([] if parallel.fsdp_reshard_after_forward else
                 ["parallel.fsdp_reshard_after_forward=true (gathers one block at a time)"])
        state += ["a larger parallel.tp (splits the weights)", "more ranks in dp (FSDP shards over dp x cp)"]
        accumulating = config.train.global_batch_size > config.train.micro_batch_size * (parallel.dp or 1)
        if accumulating and parallel.fsdp_reduce == "per_step":  # the unsharded gradients of every parameter
            state.insert(0, "parallel.fsdp_reduce=per_microbatch (no unsharded gradients between micro-batches)")
    acts = {"none": ["model.activation_checkpointing=selective (or full)"],
            "selective": ["model.activation_checkpointing=full"], "full": []}[model.activation_checkpointing]
    acts += [] if model.loss_chunk_tokens else ["model.loss_chunk_tokens=1024 (no [tokens, vocab] logits)"]
    if model.activation_checkpointing == "none":  # checkpointed slices: only outside a checkpointed block
        acts.append(f"model.mlp_chunks={2 * model.mlp_chunks}")
    acts += ["a larger parallel.cp (fewer tokens per rank)", "a smaller train.micro_batch_size or data.seq_len"]
    parts = [state, acts] if worst.state_bytes + worst.gathered_bytes >= worst.activation_bytes else [acts, state]
    return "; ".join(parts[0] + parts[1][:2])


def dry_run_world(config: Config) -> int:
    """The world size to plan for: torchrun's ``WORLD_SIZE``, else tp x cp x (dp or 1)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return math.prod((config.parallel.tp, config.parallel.cp, config.parallel.dp or 1))
