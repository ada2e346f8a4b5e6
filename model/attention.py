"""Causal self-attention: fused QKV (column parallel, GQA), optional qk-norm, RoPE, CP attention (full or a sliding
window, optionally with learned sinks; one operator, ``cp_train.parallel.cp.op``), row-parallel output.

The fused QKV weight (and its bias) is laid out by kv group: for each kv head g, the rows of its
``num_heads / num_kv_heads`` query heads, then its key head, then its value head. A
contiguous split of the rows over TP ranks is then a split by whole kv groups, so the full
weight (and the init) is the same for every tp, and query head h uses kv head
``h // (num_heads / num_kv_heads)`` as the attention kernels expect. Query heads keep Hugging Face's order, so
the per-head sinks ``[num_heads]`` split over TP like the query heads.

Under TP: the q/k/v bias is sharded with its rows; the output bias is replicated and added once, after the
reduce; the qk-norm weights are replicated and their gradients summed over TP (each rank normalises its heads).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cp_train.model.config import ModelConfig, param_seed
from cp_train.model.rope import apply_rope
from cp_train.parallel.cp.op import cp_attention
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.spec import AttentionSpec, build_spec
from cp_train.parallel.mesh.model_parallel import ModelParallel
from cp_train.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from cp_train.parallel.tp.sequence_parallel import sequence_parallel_norm


def _sinks(config: ModelConfig, name: str, parallel: ModelParallel, dtype: torch.dtype | None,
           device: torch.device | str | None) -> nn.Parameter:
    """This TP rank's slice of the layer's sinks ``[num_heads]``, drawn at full size from the seed as gpt-oss
    initialises them (normal(0, ``init_std``)); marked as split over TP along dim 0."""
    generator = torch.Generator().manual_seed(param_seed(config.seed, name))
    full = torch.empty(config.num_heads, dtype=torch.float32).normal_(0.0, config.init_std, generator=generator)
    local = full.chunk(parallel.tp_size)[parallel.tp_rank].clone()
    param = nn.Parameter(local.to(dtype=dtype or torch.get_default_dtype(), device=device))
    param.tensor_model_parallel, param.partition_dim = True, 0  # type: ignore[attr-defined]
    return param


class Attention(nn.Module):
    """Self-attention of one block. Input and output ``[B, n, hidden]``: this rank's ``n`` tokens
    of the sequence in ``parallel.layout``, replicated over the TP group; with ``parallel.sequence_parallel``
    ``[B, n/tp, hidden]``, this TP rank's shard of them (gathered before the QKV projection, reduce-scattered
    after the output projection).

    Local heads: ``num_heads / tp`` query heads and ``num_kv_heads / tp`` kv heads. ``parallel`` (validated
    once, ``ModelParallel.build``; None: no TP or CP) holds the groups, the layout and the CP algorithm.
    ``window``: this layer's sliding window (``config.layer_window(layer)``; None: full causal attention).
    """

    def __init__(self, config: ModelConfig, layer: int, parallel: ModelParallel | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        parallel = parallel or ModelParallel.build()
        self.cp_groups = parallel.cp
        self.backend = config.attention_kernel
        self.head_dim = config.head_dim
        self.window = config.layer_window(layer)
        self.group_size = config.num_heads // config.num_kv_heads  # query heads per kv head
        self.local_kv_heads = config.num_kv_heads // parallel.tp_size
        self.local_heads = self.local_kv_heads * self.group_size
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * self.head_dim
        qkv_bias, proj_bias = config.has_bias
        name = f"layers.{layer}.attention"
        tp_group, sp = parallel.tp_group, parallel.sequence_parallel
        self.qkv = ColumnParallelLinear(config.hidden_size, qkv_out, bias=qkv_bias, group=tp_group,
                                        seed=param_seed(config.seed, f"{name}.qkv"), init_std=config.init_std,
                                        dtype=dtype, device=device, sequence_parallel=sp)
        self.proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=proj_bias,
                                      input_is_parallel=True, group=tp_group,
                                      seed=param_seed(config.seed, f"{name}.proj"),
                                      init_std=config.init_std / math.sqrt(2 * config.num_layers),
                                      dtype=dtype, device=device, sequence_parallel=sp)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps, dtype=dtype, device=device)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps, dtype=dtype, device=device)
        self.sinks = _sinks(config, f"{name}.sinks", parallel, dtype, device) if config.attention_sinks else None
        # the group the qk-norm weights' gradients are summed over (each TP rank normalises its own heads)
        self.norm_group = tp_group if parallel.tp_size > 1 else None

    def _qk_norm(self, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        if norm is None:
            return x
        return norm(x) if self.norm_group is None else sequence_parallel_norm(norm, x, self.norm_group)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The roped q ``[B, n, heads/tp, D]`` and k, v ``[B, n, kv_heads/tp, D]`` of ``x`` ``[B, n, hidden]`` (or
        its sequence shard ``[B, n/tp, hidden]``); q and k normalised per head first with ``qk_norm``."""
        qkv = self.qkv(x)
        batch, n, _ = qkv.shape
        qkv = qkv.view(batch, n, self.local_kv_heads, self.group_size + 2, self.head_dim)
        q = qkv[:, :, :, : self.group_size].reshape(batch, n, self.local_heads, self.head_dim)
        k, v = qkv[:, :, :, self.group_size], qkv[:, :, :, self.group_size + 1].contiguous()
        q, k = self._qk_norm(self.q_norm, q), self._qk_norm(self.k_norm, k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: Any) -> torch.Tensor:
        """The CP attention output ``[B, n, heads/tp, D]``: the operator named by this layer's window's handle
        (``inputs.handles``; the window is its plan's) with this TP rank's sinks (None: none)."""
        return cp_attention(q, k, v, inputs.handles[self.window], self.sinks)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The row-parallel output projection of the attention output ``[B, n, heads/tp, D]``."""
        return self.proj(out.flatten(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inputs: Any) -> torch.Tensor:
        """``x`` ``[B, n, hidden]``; ``cos``/``sin`` from ``rope_tables`` of this rank's global positions;
        ``inputs`` (``block.BlockInputs``) names this forward's spec and plans, shared by every layer and
        trusted: no checks here."""
        return self.output(self.attend(*self.project(x, cos, sin), inputs))


def attention_spec(config: ModelConfig, parallel: ModelParallel, device: torch.device, dtype: torch.dtype,
                   batch: int, plan: CPPlan | None) -> AttentionSpec:
    """The spec the layers of one window share in one forward (``plan``: that window's): q ``[batch, n, heads/tp,
    head_dim]`` of ``dtype`` (the compute dtype: autocast's when it is on), causal, in the model's layout and
    algorithm."""
    kv_heads = config.num_kv_heads // parallel.tp_size
    return build_spec(device, dtype, batch, config.num_heads // parallel.tp_size, kv_heads, config.head_dim,
                      algorithm=parallel.algorithm, layout=parallel.attention_layout, causal=True,
                      backend=config.attention_kernel, plan=plan)
