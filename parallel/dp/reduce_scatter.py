"""FSDP2's gradient reduce-scatter, issued asynchronously on CPU (where FSDP2 calls it synchronously and relies
on CUDA streams for overlap): ``OverlappedReduceScatter`` and the check that FSDP2 leaves its output alone."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from cp_train.parallel.compat import reduce_scatter_single

try:  # FSDP2's pluggable reduce-scatter (a private module); without it FSDP2 keeps its own
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterBase
except ImportError:  # pragma: no cover - a torch without FSDP2's comm interfaces
    ReduceScatterBase = object


def reduces_plainly(module: FSDPModule) -> bool:
    """Whether FSDP2 leaves ``module``'s reduced gradients as the reduce-scatter wrote them (a divide factor of
    1, no dtype change), so that the reduction may still be in flight when FSDP2's own call returns."""
    if ReduceScatterBase is object or not hasattr(module, "set_custom_reduce_scatter"):
        return False
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", [])
    return len(groups) == 1 and getattr(groups[0], "gradient_divide_factor", None) == 1.0 and \
        getattr(groups[0].mp_policy, "reduce_dtype", None) in (None, groups[0].fsdp_params[0].sharded_param.dtype)


class OverlappedReduceScatter(ReduceScatterBase):
    """FSDP2's reduce-scatter issued asynchronously (CPU: FSDP2 calls it synchronously and relies on CUDA
    streams for overlap). At most ``window`` run at once, so a block's reduction travels during the next
    block's backward; all of them are complete when the backward returns (an autograd final callback), so
    nothing reads a gradient before it is reduced. The works hold their input and output buffers.

    Valid only where FSDP2 does nothing to the output after the call (``reduces_plainly``) and the sharded
    gradients are None: a backward that finds sharded gradients of ``model`` already there (FSDP2 adds the
    output into them at once) reduces in place."""

    def __init__(self, model: nn.Module, window: int = 1) -> None:
        self.model = weakref.ref(model)
        self.window = window
        self.pending: list[dist.Work] = []

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        if not self.pending and not self._start_overlap():  # the first reduction of this backward
            reduce_scatter_single(output_tensor, input_tensor, group, op=op)
            return
        self.pending.append(reduce_scatter_single(output_tensor, input_tensor, group, async_op=True, op=op))
        while len(self.pending) > self.window:
            self.pending.pop(0).wait()

    def _start_overlap(self) -> bool:
        """Whether this backward's reductions may travel: inside a backward (``finish`` is then queued to run at
        its end) and with no sharded gradient of the model there yet."""
        model = self.model()
        if model is None or _holds_sharded_grads(model):
            return False
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        except RuntimeError:  # not inside a backward
            return False
        return True

    def finish(self) -> None:
        """Wait for every reduce-scatter still in flight."""
        while self.pending:
            self.pending.pop(0).wait()


def _holds_sharded_grads(model: nn.Module) -> bool:
    """Whether any FSDP parameter of ``model`` has a sharded gradient (between micro-batches the registered
    parameters may be the unsharded ones, whose gradients FSDP2 accumulates itself)."""
    return any(param.sharded_param.grad is not None for module in model.modules() if isinstance(module, FSDPModule)
               for group in module._get_fsdp_state()._fsdp_param_groups for param in group.fsdp_params)
