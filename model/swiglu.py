"""The SwiGLU ``silu(x @ w_gate.T) * (x @ w_up.T)`` as one autograd node that keeps less for its backward.

Autograd on the plain expression keeps ``x`` (under autocast a cast per linear), gate, up and silu(gate). This
node keeps ``x`` once (cast to the compute dtype), the two weights themselves (FSDP2's resharding frees them as it
frees any linear's) and gate and up, and recomputes silu in the backward: one ``[.., ffn]`` less per layer, and one
``[.., hidden]`` less under autocast. Its gate and up gradients are the plain expression's bitwise (the same
kernels), and ``x``'s gradient sums the two matmuls in the second one's epilogue (``addmm_``).

Eager only (``model/mlp.py``): compiled, Inductor already keeps x, gate and up and recomputes silu, and measured
on CPU the node was slower there (``bench/swiglu.py``). Gate and up stay two matmuls: one matmul needs the two
weights side by side, and concatenating them for each call (forward and backward) cost more than it saved
(docs/benchmarks.md).

The compute dtype is autocast's when autocast is on for ``x``'s device, else ``x``'s; gradients come back in the
inputs' dtypes (the engine casts them). ``x`` ``[..., hidden]``, weights ``[ffn, hidden]`` (this TP rank's
column shards), result ``[..., ffn]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear on ``x`` computes in: autocast's for ``x``'s device when it is on, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


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
        grad_up = grad * F.silu(gate)  # the product's and silu's gradients as autograd computes them
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        w_gate, w_up = w_gate.to(gate.dtype), w_up.to(gate.dtype)
        rows, grad_gate, grad_up = x.flatten(0, -2), grad_gate.flatten(0, -2), grad_up.flatten(0, -2)
        grad_x = (grad_gate @ w_gate).addmm_(grad_up, w_up).view_as(x)  # the sum in the second matmul's epilogue
        return grad_x, grad_gate.t() @ rows, grad_up.t() @ rows, None


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)``, keeping what the module docstring says."""
    return _SwiGLU.apply(x, w_gate, w_up, compute_dtype(x))
