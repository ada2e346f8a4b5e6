"""Activation offload in the dry run (``model.activation_offload``; the mechanism is ``parallel/offload.py``): what
each block moves to host memory, what stays on the device, the host memory per rank and per node, and the host's
verdict.

Per block the offload moves what the block saves outside its activation checkpoints: under ``full`` its input
(``n / tp`` tokens under sequence parallelism); under ``selective`` its input and the CP attention's q, k, v,
output and fp32 lse (what the algorithm keeps inside its operator beyond those, Ulysses' sequence-ordered
copies, stays); without checkpointing (``all``) everything the block keeps but that state. The last
``KEEP_LAST_LAYERS`` blocks keep theirs on the device (the backward starts with them).

On CUDA the device then holds, beside the blocks' remaining tensors and the last block's, a prefetch window: at a
block's backward that block's fetched tensors and those of the ``PREFETCH_LAYERS`` blocks before it (the last
block's are freed by then: one block more than at the head's backward). The host holds every moved tensor in
pinned memory, each rounded up to a power of two (PyTorch's caching host allocator), from the forward until its
block's backward. On CPU host and device are one memory: nothing is saved, and the prefetched block is a second
copy of it there. With ``checkpoint.async_save`` the host also keeps a copy of each rank's parameters and
optimizer state for the run (``checkpoint_copy_bytes``), counted with the offload against a node's host memory.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

from cp_train.model.config import ModelConfig
from cp_train.parallel.cp.algorithms.costs import ACC, Shapes
from cp_train.parallel.offload import KEEP_LAST_LAYERS, PREFETCH_LAYERS

if TYPE_CHECKING:
    from cp_train.config.schema import Config

GIB = 2.0**30
# the share of a node's host memory the offload may fill: the rest for the OS, the data loader's workers, the CUDA
# and NCCL host buffers and the checkpoint writer's staging copies
HOST_USABLE_FRACTION = 0.8


class HostMemory(NamedTuple):
    """A node's host memory as the dry run checks it (the hardware profile's ``host_memory_gib``)."""

    gib_per_node: float
    ranks_per_node: int
    source: str  # where the figure comes from (a profile name), for the report

    @property
    def usable_gib(self) -> float:
        return HOST_USABLE_FRACTION * self.gib_per_node


class OffloadPlan(NamedTuple):
    """One rank's offload: ``layers`` blocks each moving ``tensors`` (bytes of each saved tensor, device side)."""

    mode: str  # model.activation_offload
    checkpointing: str  # model.activation_checkpointing: what the tensors are
    layers: int
    tensors: tuple[int, ...]
    cuda: bool

    @property
    def per_layer(self) -> int:
        """Device bytes one block moves (each way: out in the forward, back in the backward)."""
        return sum(self.tensors)

    @property
    def host_bytes(self) -> int:
        """Host bytes per rank: every moved tensor of every offloaded block, pinned blocks on CUDA."""
        return self.layers * sum(pinned(t) if self.cuda else t for t in self.tensors)

    @property
    def traffic_bytes(self) -> int:
        """Bytes over the host link per micro-batch each way."""
        return self.layers * self.per_layer


def checkpoint_copy_bytes(config: Config, parameter_bytes: int, optimizer_bytes: int) -> int:
    """Host bytes per rank of ``checkpoint.async_save``'s copy (``checkpoint/async_save.py``): the rank's parameters
    and optimizer state, page-locked in place on CUDA (not rounded up); 0 without it."""
    ckpt = config.checkpoint
    return parameter_bytes + optimizer_bytes if ckpt.async_save and ckpt.save else 0


def ranks_per_node(world: int, gpus_per_node: int = 8) -> int:
    """Ranks that share one node's host memory: torchrun's ``LOCAL_WORLD_SIZE``, else ``min(world, gpus_per_node)``."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and local.isdigit() else max(1, min(world, gpus_per_node))


def pinned(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator takes for a pinned tensor of ``nbytes``: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def moved_tensors(model: ModelConfig, s: Shapes, block: int) -> tuple[int, ...]:
    """Bytes of each tensor one block moves to the host (see the module docstring); ``block``: what a block keeps
    without checkpointing (``activations.attention_half + mlp_half``), moved as one figure under ``all``."""
    block_input = s.stream * s.hidden * s.residual
    mode = model.activation_checkpointing
    if mode == "full":
        return (block_input,)
    if mode == "selective":
        q = s.n * s.heads * s.head_dim * s.compute
        kv = s.n * s.kv_heads * s.head_dim * s.compute
        return block_input, q, kv, kv, q, s.n * s.heads * ACC  # the input, q, k, v, the output, lse
    stays = s.algorithm.kept_bytes(s) if s.cp > 1 else 0
    return (block - stays,)


def offload_plan(model: ModelConfig, s: Shapes, block: int) -> OffloadPlan | None:
    """The rank's offload for ``model.activation_offload`` (None: off)."""
    if model.activation_offload == "none":
        return None
    layers = max(0, model.num_layers - KEEP_LAST_LAYERS)
    return OffloadPlan(model.activation_offload, model.activation_checkpointing, layers,
                       moved_tensors(model, s, block), s.cuda)


def device_terms(plan: OffloadPlan | None, blocks: int) -> tuple[int, int]:
    """``(blocks, window)``: the blocks' bytes on the device with ``plan`` (``blocks`` without it), and what a
    block's backward holds on top (the prefetched blocks; on CPU their second copy)."""
    if plan is None:
        return blocks, 0
    window = PREFETCH_LAYERS * plan.per_layer
    return (blocks - plan.traffic_bytes if plan.cuda else blocks), window


def host_hint(model: ModelConfig) -> str:
    """What to change when the offloaded activations do not fit a node's host memory."""
    if model.activation_checkpointing == "none":
        return ("model.activation_checkpointing=full with model.activation_offload=checkpointed (moves only the "
                "block inputs); a larger parallel.cp over more nodes (fewer tokens per rank)")
    if model.activation_checkpointing == "selective":
        return ("model.activation_checkpointing=full (moves only the block inputs); a larger parallel.cp over more "
                "nodes (fewer tokens per rank)")
    return "a larger parallel.cp over more nodes (fewer tokens per rank); a smaller data.seq_len"
