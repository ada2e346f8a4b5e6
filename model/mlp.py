"""SwiGLU MLP, tensor parallel, optionally blockwise over the sequence (Blockwise Parallel Transformer).

With ``mlp_chunks = c > 1`` the local sequence is cut into c slices and each slice runs the
whole MLP under activation checkpointing, so its ``[tokens, ffn/tp]`` intermediates exist for
one slice at a time, in the forward and in the backward. The TP communication (identity /
all-reduce) happens once, outside the slices, so the recomputation never communicates.
Every token's result is computed by the same operations either way: chunked equals unchunked. Inside a
block under activation checkpointing the slices run plainly (the block's recompute is the only one).

``swiglu``: the SwiGLU ``silu(x @ w_gate.T) * (x @ w_up.T)`` as one autograd node that keeps less for its backward.

Autograd on the plain expression keeps ``x`` (under autocast a cast per linear), gate, up and silu(gate). This
node keeps ``x`` once (cast to the compute dtype), the two weights themselves (FSDP2's resharding frees them as it
frees any linear's) and gate and up, and recomputes silu in the backward: one ``[.., ffn]`` less per layer, and one
``[.., hidden]`` less under autocast. Its gate and up gradients are the plain expression's bitwise (the same
kernels), and ``x``'s gradient sums the two matmuls in the second one's epilogue (``addmm``).

Eager only: compiled, Inductor already keeps x, gate and up and recomputes silu, and measured
on CPU the node was slower there (``bench/swiglu.py``). Gate and up stay two matmuls: one matmul needs the two
weights side by side, and concatenating them for each call (forward and backward) cost more than it saved
(docs/benchmarks.md).

The compute dtype is autocast's when autocast is on for ``x``'s device, else ``x``'s; gradients come back in the
inputs' dtypes (the engine casts them). ``x`` ``[..., hidden]``, weights ``[ffn, hidden]`` (this TP rank's
column shards), result ``[..., ffn]``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_train.model.config import ModelConfig, param_seed
from cp_train.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, compute_dtype
from cp_train.parallel.tp.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from cp_train.parallel.tp.sequence_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,  # type: ignore[override]
                dtype: torch.dtype) -> torch.Tensor:
        x, w_gate_c, w_up_c = x.to(dtype), w_gate.to(dtype), w_up.to(dtype)
        gate, up = F.linear(x, w_gate_c), F.linear(x, w_up_c)
        ctx.save_for_backward(x, w_gate, w_up, gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, w_gate, w_up, gate, up = ctx.saved_tensors
        grad = grad.to(gate.dtype)
        # the product's and silu's gradients as autograd computes them (the product commutes), and each one's
        # matmuls before the next exists: gate and up stay saved until the node returns
        rows = x.flatten(0, -2)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate).flatten(0, -2)
        grad_x, grad_w_gate = grad_gate @ w_gate.to(gate.dtype), grad_gate.t() @ rows
        del grad_gate
        grad_up = F.silu(gate).mul_(grad).flatten(0, -2)
        torch.addmm(grad_x, grad_up, w_up.to(gate.dtype), out=grad_x)  # the sum in the matmul's epilogue
        return grad_x.view_as(x), grad_w_gate, grad_up.t() @ rows, None


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)``, keeping what the module docstring says."""
    return _SwiGLU.apply(x, w_gate, w_up, compute_dtype(x))


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up column parallel ``[ffn/tp, hidden]``, down row parallel
    ``[hidden, ffn/tp]``. Input and output ``[B, n, hidden]``, replicated over ``tp_group``; with
    ``sequence_parallel`` (at tp > 1) this rank's ``[B, n/tp, hidden]``, gathered in and reduce-scattered out.

    The parallel layers hold the (sharded, layout-independent) weights; ``forward`` applies them
    itself so that the all-reduce of ``down`` runs once per call instead of once per slice; eager, the SwiGLU is
    one autograd node that keeps less (``swiglu``; not for FP8 layers, whose matmuls are their own).
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
