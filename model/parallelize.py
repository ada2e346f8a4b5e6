"""FSDP2 applied to the GPT model (``parallel.fsdp``): parameters, gradients and AdamW state sharded over DP x CP.

The loss contract (``cp_train/loss.py``): every rank backpropagates its token-loss sum over the global token
count, so the exact gradient is the plain SUM over the DP x CP group. Both wrappers average by default:
FSDP2 is given a divide factor of 1 with sum-only collectives (DDP: ``cp_train.parallel.dp.ddp``).

FSDP2 (``shard_with_fsdp``): ``fully_shard`` on every block, then on the root, over the flattened
``dp_cp`` mesh, so parameters, gradients and AdamW state are DTensors holding 1 / (dp x cp) of each
TP-local tensor. Each module gathers the next one's parameters while it computes (forward prefetch);
on CPU, where FSDP2's collectives would block the process, the gathers and the reduce-scatters are
asynchronous (``cp_train.parallel.dp.reduce_scatter``: a block's reduction travels during the next block's backward);
``parallel.fsdp_reshard_after_forward`` false keeps the gathered parameters from the forward to the
backward and from one micro-batch to the next (ZeRO-2: fewer gathers, one full copy of the
parameters in the compute dtype). A TP-sharded parameter is sharded further within its TP rank's DP x CP group, along
dim 0, or along dim 1 when TP already splits dim 0 at tp > 1 (column-parallel weights, embedding,
head): a parameter's TP and FSDP splits then lie on different dims and its checkpoint view is a plain
2-D DTensor (``cp_train/checkpoint/dcp.py``). Runs in bf16 gather the parameters in bf16 and keep fp32 master
weights and an fp32 gradient reduction (``MixedPrecisionPolicy``).

"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from cp_train.model.gpt import GPTModel
from cp_train.model.shards import mark_tensor_parallel, tensor_parallel_dim, tensor_parallel_dims
from cp_train.parallel.dp.reduce_scatter import OverlappedReduceScatter, reduces_plainly


def fsdp_shard_dim(param: torch.Tensor, tp_size: int) -> int:
    """The dim FSDP splits ``param`` along: 1 when TP splits dim 0 at tp > 1, else 0."""
    return 1 if tp_size > 1 and tensor_parallel_dim(param) == 0 and param.dim() > 1 else 0


def shard_with_fsdp(model: GPTModel, mesh: DeviceMesh, reshard_after_forward: bool = True,
                    param_dtype: torch.dtype | None = None) -> None:
    """Apply FSDP2 to ``model`` in place (on the meta device or a real one): each block, then the root
    (embedding, norm, head), over the 1-D DP x CP ``mesh`` (or HSDP's 2-D ``("dp_replicate", "dp_shard_cp")``:
    sharded over the second dim, replicated over the first), summing gradients; TP attributes are kept.

    ``reshard_after_forward`` applies to the blocks (the root keeps its parameters until the backward);
    ``param_dtype`` (bf16 runs) is the dtype parameters are gathered and computed in."""
    dims = tensor_parallel_dims(model)
    tp_size = model.parallel.tp_size
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
        if mesh.ndim == 1 and all(reduces_plainly(module) for module in order):  # HSDP all-reduces its output
            reduce_scatter = OverlappedReduceScatter(model)
            for module in order:
                module.set_custom_reduce_scatter(reduce_scatter)
    mark_tensor_parallel(model, dims)


def release_gathered(model: torch.nn.Module) -> None:
    """Free what FSDP2 keeps gathered after a forward with no backward (an evaluation): the root's and the
    last block's parameters (every block's at ``reshard_after_forward`` false). The module holds its sharded
    DTensors again, as after a training step; a model without FSDP is left alone. Collective-free."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
