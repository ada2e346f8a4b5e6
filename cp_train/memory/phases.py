"""The moments of a training step that compete for a rank's peak memory (``dry_run.py``'s ``phase_bytes``).

On top of the rank's state (parameters, gradients, optimizer state), each moment holds transient copies
("gathered") and activations (``activations.py``):

- the head's backward in the last micro-batch: every block's activations, the head's working set; FSDP's
  gathered root and last block (every block without resharding after forward; tensorwise FP8 gathers the block
  linears' weights at 1 byte, ``gathered_in_fp8``), or without FSDP autocast's bf16 copies of the block weights
  unless the blocks are checkpointed (FP8 linears: their weights' FP8 casts under tensorwise run eager, else none;
  ``weight_copies``) and the head's bf16 weight; the unsharded
  fp32 gradients of every parameter while gradients accumulate (FSDP with ``parallel.fsdp_reduce`` per_step, in
  place of the sharded ones the state counts; DDP keeps the earlier micro-batches' gradients outside its buckets);
- a block's backward: the blocks' activations (with activation offload the prefetch window besides,
  ``offload.py``), the recomputed block and its working set; FSDP's root and two
  blocks (the current one and the next one's gather), the root's unsharded gradient (the head's) and the block's,
  and the previous block's reduce-scatter in flight; without FSDP the block copies above (a checkpointed block
  its own) and a tied head's gradient, held until the embedding's backward;
- the optimizer step: foreach AdamW's temporaries (one fp32 tensor per parameter; the fused kernels, the default,
  have none).

The state's gradients do not all exist at the first two (``gradients_made``): the trainer frees them at each
step's start (``zero_grad(set_to_none=True)``), so with one micro-batch a step and no DDP buckets only those the
backward has made by then are held (the head's, and the block's own).
"""

from __future__ import annotations

import math

import torch

from cp_train.config.schema import Config
from cp_train.model.shards import tensor_parallel_dim
from cp_train.parallel.mesh.rank_groups import ParallelDims
from cp_train.parallel.tp.fp8 import fsdp_gathers_fp8

PHASES = {"head": "the head's backward", "block": "a block's backward", "optimizer": "the optimizer step"}


def gradients_made(config: Config, dims: ParallelDims, accumulation: int) -> bool:
    """Whether every gradient of the state exists through the last micro-batch's backward: with several
    micro-batches a step (the earlier ones made them), and under DDP (``dp x cp`` > 1 without FSDP: the gradients
    are views of its buckets, which stay allocated). Else the backward makes them as it goes."""
    return accumulation > 1 or (not config.parallel.fsdp and dims.dp * dims.cp > 1)


def _reduces_per_step(config: Config) -> bool:
    """FSDP keeps unsharded gradients between micro-batches: ``fsdp_reduce`` per_step (auto unresolved counts as
    per_step, the larger)."""
    return config.parallel.fsdp_reduce != "per_microbatch"


def phase_bytes(config: Config, full: dict[str, torch.nn.Parameter], dims: ParallelDims, compute: int,
                accumulation: int, activations: dict[str, int], state: tuple[int, int], foreach: bool,
                fp8_keeps: str = "kept") -> dict[str, tuple[int, int, int]]:
    """``(gathered, activation, unmade)`` bytes of one rank at each moment of ``PHASES`` (see the module doc;
    ``unmade``: the state's gradients not made yet, ``gradients_made``); ``state``: the rank's parameter and
    gradient bytes; ``fp8_keeps``: ``Shapes.fp8_inputs``."""
    tp_local = {name: p.numel() // (dims.tp if tensor_parallel_dim(p) is not None else 1) for name, p in full.items()}
    layers, in_fp8 = config.model.num_layers, gathered_in_fp8(config, full, dims)
    blocks, root = [0] * layers, 0  # each block's parameters ("layers.{i}.*") and the rest's
    gathered = [0] * layers  # each block's bytes gathered: compute, 1 for weights FSDP gathers in FP8
    for name, n in tp_local.items():
        if name.startswith("layers."):
            index = int(name.split(".", 2)[1])
            blocks[index] += n
            gathered[index] += n * (1 if name in in_fp8 else compute)
        else:
            root += n
    every = root + sum(blocks)
    head_weight = config.model.vocab_size // dims.tp * config.model.hidden_size
    accumulating = accumulation > 1
    if config.parallel.fsdp:
        reshard = config.parallel.fsdp_reshard_after_forward
        # the unsharded fp32 gradients summed over the micro-batches, in place of the sharded ones (counted in the
        # state), which the last micro-batch's reduce-scatters make as they free them
        kept = max(0, 4 * every - state[1]) if accumulating and _reduces_per_step(config) else 0
        at_head = compute * root + (gathered[-1] if reshard else sum(gathered)) + kept
        at_block = compute * root + (min(2, layers) * max(gathered) if reshard else sum(gathered))
        at_block += (kept or compute * (head_weight + max(blocks))) + 4 * max(blocks)  # + a reduce-scatter in flight
        held = 0  # the head's gradient is the root's unsharded gradient above
    else:
        # autocast's copies of the block weights (FP8's casts), kept unless the blocks are checkpointed (recomputed:
        # the block in its backward holds its own); the head's compute-dtype weight at its backward (kept from the
        # forward with full logits, cast again by the fused loss)
        cast = compute if compute < 4 else 0
        if fp8_keeps == "bf16":  # Megatron's (Transformer Engine's) runs hold bf16 weights throughout
            copies, head_copy, recomputed = cast * every, 0, 0
        else:
            checkpointed = config.model.activation_checkpointing != "none"
            fp8 = fp8_weights(config, full, dims) if config.model.fp8 != "none" and not checkpointed else {}
            copies = weight_copies(config, fp8, 0 if checkpointed else sum(blocks), compute, fp8_keeps)
            head_copy, recomputed = cast * head_weight, cast * max(blocks) if checkpointed else 0
        outside = 4 * every if accumulating and dims.dp * dims.cp > 1 else 0  # DDP's no_sync: outside its buckets
        at_head = copies + head_copy + outside
        at_block = copies + recomputed + outside
        held = 4 * head_weight if config.model.tie_embeddings else 0  # summed with the embedding's at its backward
    # the gradients the last block's backward has: the head's (a tied one is ``held``) and the block's own; under
    # FSDP the unsharded ones above until their reduce-scatter makes the block's shard
    if config.parallel.fsdp:
        made = 4 * max(blocks) // (dims.data // config.parallel.dp_replicate)
    else:
        made = 4 * max(blocks) + (0 if config.model.tie_embeddings else 4 * head_weight)
    unmade = (0, 0) if gradients_made(config, dims, accumulation) else (state[1], max(0, state[1] - made))
    return {"head": (at_head, activations["blocks"] + activations["head"] + activations["head_backward"], unmade[0]),
            "block": (at_block, activations["blocks"] + activations["window"] + activations["block_backward"] + held,
                      unmade[1]),
            "optimizer": (state[0] if foreach else 0, 0, 0)}


def fp8_weights(config: Config, full: dict[str, torch.nn.Parameter], dims: ParallelDims) -> dict[str, list[int]]:
    """The weights whose linears compute in FP8 (``model.fp8``: the TP linears of ``ModelConfig.fp8_blocks``), with
    their TP-local shapes."""
    chosen, shapes = set(config.model.fp8_blocks), {}
    for name, param in full.items():
        tp_dim, parts = tensor_parallel_dim(param), name.split(".", 2)
        if parts[0] != "layers" or int(parts[1]) not in chosen or param.dim() != 2 or tp_dim is None:
            continue
        shapes[name] = list(param.shape)
        shapes[name][tp_dim] //= dims.tp
    return shapes


def gathered_in_fp8(config: Config, full: dict[str, torch.nn.Parameter], dims: ParallelDims) -> set[str]:
    """The block weights FSDP all-gathers in FP8, 1 byte an element (``parallel/tp/fp8.py``): under tensorwise FP8
    with FSDP, the FP8 linears' weights (``fp8_weights``) whose sharded dim splits evenly."""
    if config.model.fp8 != "tensorwise" or not config.parallel.fsdp:
        return set()
    shards = dims.data // config.parallel.dp_replicate
    return {name for name, shape in fp8_weights(config, full, dims).items()
            if fsdp_gathers_fp8(shape, tensor_parallel_dim(full[name]) == 0, dims.tp, shards)}


def weight_copies(config: Config, fp8: dict[str, list[int]], elements: int, compute: int, keeps: str) -> int:
    """Without FSDP, the copies of the ``elements`` (TP-local) block weight elements autograd keeps from the forward
    to the backward: autocast's bf16 copy of each (``compute`` 2; none in fp32), except that an FP8 linear (``fp8``:
    ``fp8_weights``) keeps its weight's FP8 cast (1 byte) where it keeps FP8 casts of its inputs (``keeps``
    "fp8", ``Shapes.fp8_inputs``), else the weight itself (torchao casts per GEMM; compiled, Inductor casts again),
    unless planned as a bf16 linear (``keeps`` "bf16")."""
    copies = compute * elements if compute == 2 else 0
    if config.model.fp8 == "none" or keeps == "bf16":
        return copies
    in_fp8 = sum(math.prod(shape) for shape in fp8.values())
    return copies - (compute * in_fp8 if compute == 2 else 0) + (in_fp8 if keeps == "fp8" else 0)
