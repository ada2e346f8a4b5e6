"""SwiGLU MLP, tensor parallel, optionally blockwise over the sequence (Blockwise Parallel Transformer).

Gate and up are one column-parallel weight ``gate_up`` ``[2 * ffn/tp, hidden]`` and one matmul: its rows alternate
gate's and up's blocks of ``gate_up_block(ffn)`` rows (64 for the usual widths, at least 8 blocks;
``gate_up_pairs``), so the elementwise SwiGLU reads contiguous runs. HF's ``gate_proj`` and ``up_proj`` load into
and export from the two block sets (``model/hf/weights.py``). The layout does not depend on tp: TP rank r holds the
blocks of ffn rows ``[r*ffn/tp, (r+1)*ffn/tp)``, exactly the columns of ``down`` it holds, and the initial values
are those of two weights drawn from their own seeds (``mlp.gate`` and ``mlp.up``).

With ``mlp_chunks = c > 1`` the local sequence is cut into c slices and each slice runs the
whole MLP under activation checkpointing, so its ``[tokens, ffn/tp]`` intermediates exist for
one slice at a time, in the forward and in the backward. The TP communication (identity /
all-reduce) happens once, outside the slices, so the recomputation never communicates.
Every token's result is computed by the same operations either way: chunked equals unchunked. Inside a
block under activation checkpointing the slices run plainly (the block's recompute is the only one).

``swiglu``: ``silu(gate) * up`` of ``x @ w_gate_up.T`` as one autograd node that keeps less for its backward.
Autograd on the plain expression keeps ``x`` (under autocast its cast), the matmul's output and silu(gate). This
node keeps ``x`` once (cast to the compute dtype), the weight itself (FSDP2's resharding frees it as it frees any
linear's) and the matmul's output, recomputes silu in the backward and turns the saved output into its own
gradient in place (one backward per forward, as autograd's version check enforces): one ``[.., ffn]`` less per
layer, and one ``[.., hidden]`` less under autocast. Its output and gradients are autograd's on the plain expression
bitwise (the same kernels); ``x``'s and the weight's gradients are one matmul each.

Eager only: compiled, and under FP8 (whose matmul is the layer's own), the MLP runs the layer's matmul and then
``gated_silu``, which keeps the matmul's output alone and whose backward Inductor compiles to one kernel; compiled
inside an activation checkpoint, the plain expression (torch 2.11's compile keeps an autograd Function's output
there, one ``[.., ffn]`` per block, where it recomputes the expression; 2.13 recomputes both). The
compute dtype is autocast's when autocast is on for ``x``'s device, else ``x``'s; gradients come back in the inputs'
dtypes (the engine casts them). ``x`` ``[..., hidden]``, weight ``[2 * ffn, hidden]`` (this TP rank's blocks), result
``[..., ffn]``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_train.model.config import ModelConfig, gate_up_block, param_seed
from cp_train.parallel.tp.layers import ColumnParallelLinear, InitMethod, RowParallelLinear, compute_dtype
from cp_train.parallel.tp.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from cp_train.parallel.tp.sequence_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def gate_up_pairs(tensor: torch.Tensor, block: int, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate's and up's parts of a tensor whose ``dim`` (``2 * ffn`` long) alternates their ``block``-row blocks:
    views whose ``dim`` becomes ``[ffn / block, block]``."""
    dim = dim % tensor.dim()
    blocks = tensor.unflatten(dim, (-1, 2, block))
    return blocks.select(dim + 1, 0), blocks.select(dim + 1, 1)


def split_gate_up(tensor: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full fused ``[2 * ffn, ...]`` weight as gate's and up's ``[ffn, ...]`` (copies)."""
    return tuple(part.flatten(0, 1) for part in gate_up_pairs(tensor, block))  # type: ignore[return-value]


def pair_gate_up(gate: torch.Tensor, up: torch.Tensor, block: int) -> torch.Tensor:
    """``[2 * ffn, ...]``: gate's and up's ``[ffn, ...]`` in alternating ``block``-row blocks (``split_gate_up``'s
    inverse)."""
    return torch.stack((gate.unflatten(0, (-1, block)), up.unflatten(0, (-1, block))), dim=1).flatten(0, 2)


def _paired_init(gate_seed: int, up_seed: int, std: float, block: int) -> InitMethod:
    """Fills the full ``[2 * ffn, hidden]`` weight with two normal(0, std) weights drawn from their own seeds."""
    def init(full: torch.Tensor, _generator: torch.Generator) -> None:
        for part, seed in zip(gate_up_pairs(full, block), (gate_seed, up_seed), strict=True):
            drawn = torch.empty(part.shape[0] * block, *part.shape[2:])
            part.copy_(drawn.normal_(0.0, std, generator=torch.Generator().manual_seed(seed)).view_as(part))
    return init


def _silu_product(out: torch.Tensor, block: int) -> torch.Tensor:
    """``silu(gate) * up`` ``[..., ffn]`` of the fused matmul's output ``out`` ``[..., 2 * ffn]``."""
    gate, up = gate_up_pairs(out, block, -1)
    return (F.silu(gate) * up).flatten(-2)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate_up: torch.Tensor, block: int,  # type: ignore[override]
                dtype: torch.dtype) -> torch.Tensor:
        x = x.to(dtype)
        out = F.linear(x, w_gate_up.to(dtype))
        ctx.save_for_backward(x, w_gate_up, out)
        ctx.block = block
        return _silu_product(out, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:  # type: ignore[override]
        # a second backward through one forward (retain_graph) finds ``out`` modified: autograd's version check
        # raises (under activation checkpointing each backward recomputes it, and runs)
        x, w_gate_up, out = ctx.saved_tensors
        gate, up = gate_up_pairs(out, ctx.block, -1)
        grad = grad.to(out.dtype).unflatten(-1, (-1, ctx.block))
        # the product's and silu's gradients as autograd computes them (the product commutes), written over
        # gate and up: one [.., ffn] temporary (up's gradient) at a time
        grad_up = F.silu(gate).mul_(grad)
        up.mul_(grad)
        torch.ops.aten.silu_backward.grad_input(up, gate, grad_input=gate)
        up.copy_(grad_up)
        del grad_up
        rows = out.flatten(0, -2)
        grad_x = rows @ w_gate_up.to(out.dtype)
        return grad_x.view_as(x), rows.t() @ x.flatten(0, -2), None, None


class _GatedSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, block: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(out)
        ctx.block = block
        return _silu_product(out, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        gate, up = gate_up_pairs(out, ctx.block, -1)
        grad = grad.unflatten(-1, (-1, ctx.block))
        grad_gate, grad_up = torch.ops.aten.silu_backward(grad * up, gate), F.silu(gate) * grad
        return torch.stack((grad_gate, grad_up), dim=-2).flatten(-3), None


def gated_silu(out: torch.Tensor, block: int) -> torch.Tensor:
    """``silu(gate) * up`` ``[..., ffn]`` of the fused matmul's output ``out`` ``[..., 2 * ffn]`` (``block``-row blocks
    alternating), keeping only ``out``: silu is recomputed, and the backward writes both gradients into their
    blocks with one stack (compiled, one kernel; autograd on the views writes each half into a zeroed buffer). What
    the MLP runs compiled and under FP8, after the layer's own matmul."""
    return _GatedSiLU.apply(out, block)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w_gate_up.T`` (gate's and up's ``block``-row blocks alternating:
    ``gate_up_pairs``), keeping what the module docstring says."""
    return _SwiGLU.apply(x, w_gate_up, block, compute_dtype(x))


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up one column-parallel weight ``gate_up`` ``[2 * ffn/tp, hidden]``
    (alternating blocks: ``gate_up_pairs``), down row parallel ``[hidden, ffn/tp]``. Input and output ``[B, n,
    hidden]``, replicated over ``tp_group``; with ``sequence_parallel`` (at tp > 1) this rank's ``[B, n/tp, hidden]``,
    gathered in and reduce-scattered out.

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
        self.block = gate_up_block(ffn)  # each TP rank holds whole blocks (``ModelConfig.validate`` checks tp)
        init = _paired_init(param_seed(config.seed, f"{name}.gate"), param_seed(config.seed, f"{name}.up"),
                            config.init_std, self.block)
        self.gate_up = ColumnParallelLinear(hidden, 2 * ffn, init_method=init, **common)
        self.down = RowParallelLinear(ffn, hidden, input_is_parallel=True,
                                      seed=param_seed(config.seed, f"{name}.down"),
                                      init_std=config.init_std / math.sqrt(2 * config.num_layers), **common)

    def local_mlp(self, x: torch.Tensor, recomputed: bool | None = None) -> torch.Tensor:
        """This rank's partial sum of the output for tokens ``x`` ``[B, m, hidden]`` (no communication);
        ``recomputed``: whether this runs inside an activation checkpoint (default: the block's)."""
        gate_up, down = self.gate_up, self.down  # each layer's local matmul (model.fp8: FP8's)
        compiling = torch.compiler.is_compiling()
        if gate_up.linear_fn is F.linear and not compiling:
            act = swiglu(x, gate_up.weight, self.block)  # keeps no silu (compiled, Inductor does so itself)
        elif compiling and (not self.checkpoint_chunks if recomputed is None else recomputed):
            act = _silu_product(gate_up.linear_fn(x, gate_up.weight), self.block)  # see the module docstring
        else:
            act = gated_silu(gate_up.linear_fn(x, gate_up.weight), self.block)
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
            partial = torch.cat([checkpoint(self.local_mlp, piece, True, use_reentrant=False)
                                 for piece in x.tensor_split(chunks, dim=1)], dim=1)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_parallel_region(partial, self.tp_group)
