"""Gradients summed over DP x CP by PyTorch's own wrappers: FSDP2 (``parallel.fsdp``) or DDP.

The loss contract (``loss.py``): every rank backpropagates its token-loss sum over the global token
count, so the exact gradient is the plain SUM over the DP x CP group. Both wrappers average by default:
FSDP2 is given a divide factor of 1 with sum-only collectives, DDP a comm hook that all-reduces with SUM.

FSDP2 (``shard_with_fsdp``): ``fully_shard`` on every block, then on the root, over the flattened
``dp_cp`` mesh, so parameters, gradients and AdamW state are DTensors holding 1 / (dp x cp) of each
TP-local tensor. Each module gathers the next one's parameters while it computes (forward prefetch);
on CPU, where FSDP2's collectives would block the process, the gathers and the reduce-scatters are
asynchronous (``OverlappedReduceScatter``: a block's reduction travels during the next block's backward);
``parallel.fsdp_reshard_after_forward`` false keeps the gathered parameters from the forward to the
backward and from one micro-batch to the next (ZeRO-2: fewer gathers, one full copy of the
parameters in the compute dtype). A TP-sharded parameter is sharded further within its TP rank's DP x CP group, along
dim 0, or along dim 1 when TP already splits dim 0 at tp > 1 (column-parallel weights, embedding,
head): a parameter's TP and FSDP splits then lie on different dims and its checkpoint view is a plain
2-D DTensor (``checkpoint.py``). Runs in bf16 gather the parameters in bf16 and keep fp32 master
weights and an fp32 gradient reduction (``MixedPrecisionPolicy``).

Gradient accumulation: run each micro-batch's backward inside ``gradient_sync(module, last)``; nothing
is reduced until the last micro-batch (FSDP2 keeps the unsharded sum, DDP its buckets).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from cp_train.model.gpt import GPTModel
from cp_train.model.shards import mark_tensor_parallel, tensor_parallel_dim, tensor_parallel_dims
from cp_train.parallel.compat import ReduceScatterBase, reduce_scatter_single
from cp_train.parallel.mesh.collectives import note_failure


def fsdp_shard_dim(param: torch.Tensor, tp_size: int) -> int:
    """The dim FSDP splits ``param`` along: 1 when TP splits dim 0 at tp > 1, else 0."""
    return 1 if tp_size > 1 and tensor_parallel_dim(param) == 0 and param.dim() > 1 else 0


def shard_with_fsdp(model: GPTModel, mesh: DeviceMesh, reshard_after_forward: bool = True,
                    param_dtype: torch.dtype | None = None) -> None:
    """Apply FSDP2 to ``model`` in place (on the meta device or a real one): each block, then the root
    (embedding, norm, head), over the 1-D DP x CP ``mesh``, summing gradients; TP attributes are kept.

    ``reshard_after_forward`` applies to the blocks (the root keeps its parameters until the backward);
    ``param_dtype`` (bf16 runs) is the dtype parameters are gathered and computed in."""
    dims = tensor_parallel_dims(model)
    tp_size = model.tp_size
    for name, param in model.named_parameters():
        if dims[name] is not None and tp_size > 1 and param.dim() == 1:
            raise ValueError(f"FSDP cannot shard the 1-D tensor-parallel parameter {name} within its TP group")
    # no input casting: it would rebuild every block's plan (losing its per-device index cache); the blocks'
    # activations arrive in the compute dtype already, and RoPE casts its tables to q's dtype
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                                  cast_forward_inputs=False)
    common = {"mesh": mesh, "mp_policy": policy,
              "shard_placement_fn": lambda param: Shard(fsdp_shard_dim(param, tp_size))}
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers):  # the last block's parameters are needed again at once
        fully_shard(block, reshard_after_forward=reshard_after_forward and index < last, **common)
    fully_shard(model, **common)
    order = [model, *model.layers]  # each gathers the next block's parameters while it computes
    for current, following in zip(order[:-1], order[1:], strict=True):
        current.set_modules_to_forward_prefetch([following])
    for module in order:
        module.set_gradient_divide_factor(1.0)  # the SUM over DP x CP, not the mean
        module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    if mesh.device_type == "cpu" and hasattr(model, "_set_unshard_async_op"):
        # without CUDA streams a synchronous collective blocks the process: issue the gathers and the
        # reduce-scatters asynchronously, so they run while the neighbouring blocks compute (bench/fsdp.py)
        model._set_unshard_async_op(True)
        if all(_reduces_plainly(module) for module in order):
            reduce_scatter = OverlappedReduceScatter(model)
            for module in order:
                module.set_custom_reduce_scatter(reduce_scatter)
    mark_tensor_parallel(model, dims)


def _reduces_plainly(module: FSDPModule) -> bool:
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

    Valid only where FSDP2 does nothing to the output after the call (``_reduces_plainly``) and the sharded
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


def _sum_all_reduce(group, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations: none, or its objects
    """DDP comm hook (a ``dist.GradBucket`` -> ``Future[Tensor]``): all-reduce the bucket with SUM (DDP's own
    hook divides by the group size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)

    def summed(future: torch.futures.Future) -> torch.Tensor:
        try:
            return future.value()[0]
        except Exception as error:  # DDP re-raises it wrapped: record which collective failed
            note_failure(error, "all_reduce", group)
            raise

    return work.get_future().then(summed)


def replicate_with_ddp(model: nn.Module, group: dist.ProcessGroup, bucket_mb: float) -> nn.Module:
    """``model`` under DDP over ``group`` (DP x CP) with a SUM of the gradients; ``model`` itself when the group
    has one rank (nothing to reduce)."""
    if dist.get_world_size(group) == 1:
        return model
    wrapped = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb,
                                      gradient_as_bucket_view=True)
    wrapped.register_comm_hook(group, _sum_all_reduce)
    return wrapped


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool, keep_gathered: bool = False) -> Iterator[None]:
    """Run one micro-batch's backward with (``enabled``: the last micro-batch) or without the DP x CP reduction.

    FSDP: the root's parameters (embedding, norm, head: gathered for the whole forward and backward anyway)
    stay gathered from one micro-batch to the next; with ``keep_gathered`` (no resharding after forward,
    ZeRO-2) every block's do too, so each is gathered once per step instead of once per micro-batch."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        module.set_reshard_after_backward(enabled, recurse=keep_gathered)
        yield
    elif isinstance(module, DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
    else:
        yield
