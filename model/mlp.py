"""SwiGLU MLP, tensor parallel, optionally blockwise over the sequence (Blockwise Parallel Transformer).

With ``mlp_chunks = c > 1`` the local sequence is cut into c slices and each slice runs the
whole MLP under activation checkpointing, so its ``[tokens, ffn/tp]`` intermediates exist for
one slice at a time, in the forward and in the backward. The TP communication (identity /
all-reduce) happens once, outside the slices, so the recomputation never communicates.
Every token's result is computed by the same operations either way: chunked equals unchunked. Inside a
block under activation checkpointing the slices run plainly (the block's recompute is the only one).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_train.model.config import ModelConfig, param_seed
from cp_train.model.swiglu import swiglu
from cp_train.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from cp_train.parallel.tp.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from cp_train.parallel.tp.sequence_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up column parallel ``[ffn/tp, hidden]``, down row parallel
    ``[hidden, ffn/tp]``. Input and output ``[B, n, hidden]``, replicated over ``tp_group``; with
    ``sequence_parallel`` (at tp > 1) this rank's ``[B, n/tp, hidden]``, gathered in and reduce-scattered out.

    The parallel layers hold the (sharded, layout-independent) weights; ``forward`` applies them
    itself so that the all-reduce of ``down`` runs once per call instead of once per slice; eager, the SwiGLU is
    one autograd node that keeps less (``swiglu.py``; not for FP8 layers, whose matmuls are their own).
    """

    def __init__(self, config: ModelConfig, layer: int, tp_group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp_group, self.chunks = tp_group, config.mlp_chunks
        self.sequence_parallel = sequence_parallel and tp_group is not None and dist.get_world_size(tp_group) > 1
        # inside a checkpointed block the block's recompute already bounds what the slices keep: checkpointing
        # them again would only run each slice's forward a third time
        self.checkpoint_chunks = config.activation_checkpointing == "none"
        hidden, ffn, name = config.hidden_size, config.ffn_hidden_size, f"layers.{layer}.mlp"
        common = {"bias": False, "group": tp_group, "dtype": dtype, "device": device}
        self.gate = ColumnParallelLinear(hidden, ffn, seed=param_seed(config.seed, f"{name}.gate"),
                                         init_std=config.init_std, **common)
        self.up = ColumnParallelLinear(hidden, ffn, seed=param_seed(config.seed, f"{name}.up"),
                                       init_std=config.init_std, **common)
        self.down = RowParallelLinear(ffn, hidden, input_is_parallel=True,
                                      seed=param_seed(config.seed, f"{name}.down"),
                                      init_std=config.init_std / math.sqrt(2 * config.num_layers), **common)

    def local_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the output for tokens ``x`` ``[B, m, hidden]`` (no communication)."""
        gate, up, down = self.gate, self.up, self.down  # each layer's local matmul (model.fp8: FP8's)
        if gate.linear_fn is F.linear and up.linear_fn is F.linear and not torch.compiler.is_compiling():
            act = swiglu(x, gate.weight, up.weight)  # keeps no silu (compiled, Inductor does so itself)
        else:
            act = F.silu(gate.linear_fn(x, gate.weight)) * up.linear_fn(x, up.weight)
        return down.linear_fn(act, down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        chunks = min(self.chunks, x.shape[1])
        if chunks <= 1:
            partial = self.local_mlp(x)
        elif not (torch.is_grad_enabled() and self.checkpoint_chunks):
            partial = torch.cat([self.local_mlp(piece) for piece in x.tensor_split(chunks, dim=1)], dim=1)
        else:
            partial = torch.cat([checkpoint(self.local_mlp, piece, use_reentrant=False)
                                 for piece in x.tensor_split(chunks, dim=1)], dim=1)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_parallel_region(partial, self.tp_group)
