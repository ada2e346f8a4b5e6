"""Causal self-attention: fused QKV (column parallel, GQA), RoPE, ring attention over CP, row-parallel output.

The fused QKV weight is laid out by kv group: for each kv head g, the rows of its
``num_heads / num_kv_heads`` query heads, then its key head, then its value head. A
contiguous split of the rows over TP ranks is then a split by whole kv groups, so the full
weight (and the init) is the same for every tp, and query head h uses kv head
``h // (num_heads / num_kv_heads)`` as the attention kernels expect.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cp_train.model.config import ModelConfig, param_seed
from cp_train.model.rope import apply_rope
from cp_train.parallel.cp.op import cp_attention
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.spec import AttentionSpec, build_spec
from cp_train.parallel.mesh.model_parallel import ModelParallel
from cp_train.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear


class Attention(nn.Module):
    """Self-attention of one block. Input and output ``[B, n, hidden]``: this rank's ``n`` tokens
    of the sequence in ``parallel.layout``, replicated over the TP group; with ``parallel.sequence_parallel``
    ``[B, n/tp, hidden]``, this TP rank's shard of them (gathered before the QKV projection, reduce-scattered
    after the output projection).

    Local heads: ``num_heads / tp`` query heads and ``num_kv_heads / tp`` kv heads. ``parallel`` (validated
    once, ``ModelParallel.build``; None: no TP or CP) holds the groups, the layout and the CP algorithm.
    """

    def __init__(self, config: ModelConfig, layer: int, parallel: ModelParallel | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        parallel = parallel or ModelParallel.build()
        self.cp_groups = parallel.cp
        self.backend = config.attention_backend
        self.head_dim = config.head_dim
        self.group_size = config.num_heads // config.num_kv_heads  # query heads per kv head
        self.local_kv_heads = config.num_kv_heads // parallel.tp_size
        self.local_heads = self.local_kv_heads * self.group_size
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * self.head_dim
        name = f"layers.{layer}.attention"
        tp_group, sp = parallel.tp_group, parallel.sequence_parallel
        self.qkv = ColumnParallelLinear(config.hidden_size, qkv_out, bias=False, group=tp_group,
                                        seed=param_seed(config.seed, f"{name}.qkv"), init_std=config.init_std,
                                        dtype=dtype, device=device, sequence_parallel=sp)
        self.proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=False,
                                      input_is_parallel=True, group=tp_group,
                                      seed=param_seed(config.seed, f"{name}.proj"),
                                      init_std=config.init_std / math.sqrt(2 * config.num_layers),
                                      dtype=dtype, device=device, sequence_parallel=sp)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The roped q ``[B, n, heads/tp, D]`` and k, v ``[B, n, kv_heads/tp, D]`` of ``x`` ``[B, n, hidden]`` (or
        its sequence shard ``[B, n/tp, hidden]``)."""
        qkv = self.qkv(x)
        batch, n, _ = qkv.shape
        qkv = qkv.view(batch, n, self.local_kv_heads, self.group_size + 2, self.head_dim)
        q = qkv[:, :, :, : self.group_size].reshape(batch, n, self.local_heads, self.head_dim)
        k, v = qkv[:, :, :, self.group_size], qkv[:, :, :, self.group_size + 1].contiguous()
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The row-parallel output projection of the attention output ``[B, n, heads/tp, D]``."""
        return self.proj(out.flatten(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, n, hidden]``; ``cos``/``sin`` from ``rope_tables`` of this rank's global positions;
        ``handle`` names this forward's spec and plan (``cp_train.parallel.cp.op.plan_handle`` of
        ``attention_spec`` and ``GPTModel.build_cp_plan``), shared by every layer and trusted: no checks here."""
        return self.output(cp_attention(*self.project(x, cos, sin), handle))


def attention_spec(config: ModelConfig, parallel: ModelParallel, device: torch.device, dtype: torch.dtype,
                   batch: int, plan: CPPlan | None) -> AttentionSpec:
    """The spec every layer's attention shares in one forward: q ``[batch, n, heads/tp, head_dim]`` of
    ``dtype`` (the compute dtype: autocast's when it is on), causal, in the model's layout and algorithm."""
    kv_heads = config.num_kv_heads // parallel.tp_size
    return build_spec(device, dtype, batch, config.num_heads // parallel.tp_size, kv_heads, config.head_dim,
                      algorithm=parallel.algorithm, layout=parallel.attention_layout, causal=True,
                      backend=config.attention_backend, plan=plan)
