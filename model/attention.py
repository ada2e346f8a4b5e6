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
import torch.distributed as dist
from torch import nn

from cp_train.model.config import ModelConfig, param_seed
from cp_train.model.rope import apply_rope
from cp_train.parallel.cp.attention import as_groups, context_parallel_attention
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.mesh.groups import CPGroups
from cp_train.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, group_size_and_rank


class Attention(nn.Module):
    """Self-attention of one block. Input and output ``[B, n, hidden]``: this rank's ``n`` tokens
    of the sequence in ``cp_layout``, replicated over ``tp_group``.

    Local heads: ``num_heads / tp`` query heads and ``num_kv_heads / tp`` kv heads. ``cp_group``
    None means no CP (the local sequence is the whole sequence); ``cp_algorithm`` how CP attends.
    """

    def __init__(self, config: ModelConfig, layer: int, tp_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | CPGroups | None = None, cp_layout: str = "zigzag",
                 cp_algorithm: str = "ring", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        tp, _ = group_size_and_rank(tp_group)
        self.cp_groups = as_groups(cp_group)
        self.cp_layout = cp_layout if self.cp_groups.size > 1 else "contiguous"  # cp=1: all alike
        self.cp_algorithm = cp_algorithm
        self.backend = config.attention_backend
        self.head_dim = config.head_dim
        self.group_size = config.num_heads // config.num_kv_heads  # query heads per kv head
        self.local_kv_heads = config.num_kv_heads // tp
        self.local_heads = self.local_kv_heads * self.group_size
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * self.head_dim
        name = f"layers.{layer}.attention"
        self.qkv = ColumnParallelLinear(config.hidden_size, qkv_out, bias=False, group=tp_group,
                                        seed=param_seed(config.seed, f"{name}.qkv"), init_std=config.init_std,
                                        dtype=dtype, device=device)
        self.proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=False,
                                      input_is_parallel=True, group=tp_group,
                                      seed=param_seed(config.seed, f"{name}.proj"),
                                      init_std=config.init_std / math.sqrt(2 * config.num_layers),
                                      dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: CPPlan | None = None) -> torch.Tensor:
        """``x`` ``[B, n, hidden]``; ``cos``/``sin`` from ``rope_tables`` of this rank's global positions;
        ``plan`` the batch's CP plan (``parallel.cp_attention.attention_plan``; None: built here)."""
        batch, n, _ = x.shape
        qkv = self.qkv(x).view(batch, n, self.local_kv_heads, self.group_size + 2, self.head_dim)
        q = qkv[:, :, :, : self.group_size].reshape(batch, n, self.local_heads, self.head_dim)
        k, v = qkv[:, :, :, self.group_size], qkv[:, :, :, self.group_size + 1].contiguous()
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = context_parallel_attention(q, k, v, self.cp_groups, self.cp_layout, causal=True,
                                         backend=self.backend, plan=plan, algorithm=self.cp_algorithm)
        return self.proj(out.reshape(batch, n, self.local_heads * self.head_dim))
