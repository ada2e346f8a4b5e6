"""The GPT decoder: vocab-parallel embedding, pre-norm blocks, final RMSNorm, vocab-parallel LM head.

Each rank holds ``n`` tokens of every sample: its slice of the sequence in the CP layout
(``cp_train.parallel.cp.layout``), the same slice on every rank of its TP group (with sequence parallelism
the blocks' residual stream holds this TP rank's 1/tp of it; the embedding and the head take and give all
n). With ``labels`` the model returns the per-token loss ``[B, n]`` (fp32, from ``vocab_parallel_cross_entropy``;
the trainer owns the reduction over tokens and ranks), else this rank's vocab shard of the
logits ``[B, n, vocab/tp]``. Every parameter is drawn from ``config.seed`` and its name only,
so all layouts hold the same model; TP-sharded parameters carry ``partition_dim``, the rest are
replicated (their gradients must be summed over CP and DP like every other gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_train.model.attention import attention_spec
from cp_train.model.block import Block, BlockInputs, rms_norm
from cp_train.model.config import ModelConfig, param_seed
from cp_train.model.rope import rope_tables
from cp_train.parallel.cp.attention import build_cp_plan
from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.cp.op import plan_handle
from cp_train.parallel.cp.plan.batch_plan import CPPlan, SamplePlanner
from cp_train.parallel.cp.plan.layer_plans import LayerPlans, LayerSamplePlanner
from cp_train.parallel.cp.plan.window_plan import as_window
from cp_train.parallel.mesh.model_parallel import ModelParallel
from cp_train.parallel.tp.fused_loss import linear_cross_entropy
from cp_train.parallel.tp.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    compute_dtype,
    vocab_parallel_cross_entropy,
)
from cp_train.parallel.tp.mappings import copy_to_tensor_parallel_region
from cp_train.parallel.tp.sequence_parallel import gather_from_sequence_parallel_region, sequence_parallel_norm


def _embedding(config: ModelConfig, tp_group: dist.ProcessGroup | None, sequence_parallel: bool = False,
               **factory: Any) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group,
                                  seed=param_seed(config.seed, "embedding"), init_std=config.init_std,
                                  sequence_parallel=sequence_parallel, **factory)


def _lm_head(config: ModelConfig, tp_group: dist.ProcessGroup | None, **factory: Any) -> ColumnParallelLinear:
    return ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False, group=tp_group,
                                seed=param_seed(config.seed, "lm_head"), init_std=config.init_std, **factory)


def _is_int(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


class GPTModel(nn.Module):
    """GPT over the TP and CP groups of ``parallel`` (``ModelParallel``, validated once; None: no TP or CP),
    which also says how the sequence is split over CP (``parallel.layout``) and how CP attends
    (``parallel.algorithm``: a ``CPAlgorithm``). The model checks it against ``config`` here,
    once; the layers trust it."""

    def __init__(self, config: ModelConfig, parallel: ModelParallel | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        parallel = parallel or ModelParallel.build()
        config.validate(parallel.tp_size, parallel.cp_size, layout=parallel.layout)
        parallel.algorithm.check_heads(config.num_heads // parallel.tp_size, config.num_kv_heads // parallel.tp_size,
                                       parallel.cp_size, parallel.cp.ulysses_size)
        self.config, self.parallel = config, parallel
        self.layer_pairs: float | None = None  # the last forward's mean_layer_pairs (what the MFU counts)
        factory = {"dtype": dtype, "device": device}
        self.embedding = _embedding(config, parallel.tp_group, parallel.sequence_parallel, **factory)
        self.layers = nn.ModuleList(Block(config, i, parallel, **factory) for i in range(config.num_layers))
        self.norm = rms_norm(config.hidden_size, config.norm_eps, config.norm, **factory)
        self.lm_head = None if config.tie_embeddings else _lm_head(config, parallel.tp_group, **factory)
        self.compiled_parts: list[str] = []  # what ``compile_parts`` compiled

    def reference_units(self) -> Iterator[tuple[str, nn.Module]]:
        """``(name, module)`` for each child (the embedding, every block, the norm, the head), built one at a
        time at full size (tp = 1) on the CPU from the seed: the values every layout's shards are cut from."""
        config = self.config
        yield "embedding", _embedding(config, None)
        for i in range(config.num_layers):
            yield f"layers.{i}", Block(config, i)
        yield "norm", rms_norm(config.hidden_size, config.norm_eps, config.norm)
        if self.lm_head is not None:
            yield "lm_head", _lm_head(config, None)

    def local_positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions ``[local_len]`` of this rank's tokens in the CP layout."""
        p = self.parallel
        return sequence_positions(local_len * p.cp_size, p.cp_rank, p.cp_size, p.attention_layout, device)

    def _check_inputs(self, tokens: torch.Tensor, position_ids: torch.Tensor | None,
                      labels: torch.Tensor | None, document_ids: torch.Tensor | None) -> None:
        if tokens.dim() != 2 or not _is_int(tokens):
            raise ValueError(f"tokens must be an integer tensor [batch, local_seqlen], got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        batch, n = tokens.shape
        self.config.check_sequence(n * self.parallel.cp_size, self.parallel.cp_size, self.parallel.layout)
        if self.parallel.sequence_parallel and n % self.parallel.tp_size:
            raise ValueError(f"sequence parallelism splits this rank's {n} tokens over tp = {self.parallel.tp_size}, "
                             f"which must divide them; make the sequence a multiple of cp*tp = "
                             f"{self.parallel.cp_size * self.parallel.tp_size} or turn sequence_parallel off")
        if position_ids is not None and (not _is_int(position_ids)
                                         or tuple(position_ids.shape) not in ((batch, n), (n,))):
            raise ValueError(f"position_ids must be integer [batch, local_seqlen] = [{batch}, {n}] (or [{n}]), "
                             f"got {position_ids.dtype} {tuple(position_ids.shape)}")
        for name, x in (("labels", labels), ("document_ids", document_ids)):
            if x is not None and (not _is_int(x) or x.shape != tokens.shape):
                raise ValueError(f"{name} must be an integer tensor shaped like tokens {tuple(tokens.shape)}, got "
                                 f"{x.dtype} {tuple(x.shape)}")

    def build_cp_plan(self, local_len: int, document_ids: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None) -> CPPlan | None:
        """The batch's CP plan (every layer uses it): see ``forward``'s arguments."""
        p = self.parallel
        return build_cp_plan(p.cp, p.attention_layout, True, local_len, document_ids, position_ids, p.algorithm)

    def layer_plans(self, local_len: int, document_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                    plan: CPPlan | LayerPlans | None, device: torch.device | None = None
                    ) -> dict[int | None, CPPlan | None]:
        """``{window: plan}`` for the layers' attention: ``plan`` (the full layers') under None, and the batch's
        plan of each sliding window the layers use (``build_cp_plan(..., window=W)``, on ``device``: a static plan's
        copy is moved once and kept), or
        those the data loader made (``plan`` a ``LayerPlans``: ``sample_planner``)."""
        if isinstance(plan, LayerPlans):
            return plan.by_window()
        p, plans = self.parallel, {None: plan}
        for window in sorted({w for w in self.config.windows if w is not None}):
            built = build_cp_plan(p.cp, p.attention_layout, True, local_len, document_ids, position_ids, p.algorithm,
                                  window=window)
            plans[window] = built if built is None or device is None else built.on_device(device)  # static: once
        return plans

    def mean_layer_pairs(self, plans: dict[int | None, CPPlan | None]) -> float | None:
        """The visible query-key pairs of ``plans`` (``layer_plans``) averaged over the layers, each layer counting
        its window's plan (what the MFU counts: ``model.family``); None when a plan does not count its pairs (a
        static plan, or none). After each ``forward`` the model keeps its batch's value in ``layer_pairs``."""
        counted = [plans.get(window) for window in self.config.windows]
        if any(p is None or not p.pairs for p in counted):
            return None
        return sum(p.pairs for p in counted) / len(counted)

    def sample_planner(self) -> SamplePlanner | LayerSamplePlanner:
        """``build_cp_plan`` for a data loader that holds whole samples (``cp_train.data.loader``): the same plan,
        made from every CP rank's document ids without communication; with sliding windows, every window's plan
        too (a ``LayerPlans`` per batch)."""
        p = self.parallel
        full = SamplePlanner(p.algorithm, p.cp_size, p.cp_rank, p.cp.ulysses_size)
        windows = sorted({w for w in self.config.windows if w is not None})
        if not windows:
            return full
        return LayerSamplePlanner(full, {w: SamplePlanner(p.algorithm, p.cp_size, p.cp_rank, p.cp.ulysses_size,
                                                          window=as_window(w, True)) for w in windows})

    @contextlib.contextmanager
    def without_context_parallel(self) -> Iterator[None]:
        """Inside the block, ``forward`` takes whole sequences ``[B, seq_len]`` and attends on this rank alone (no CP
        communication; TP, FSDP and the weights as they are): the in-run CP check's reference."""
        parallel = self.parallel
        self.parallel = parallel.without_cp()
        try:
            yield
        finally:
            self.parallel = parallel

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                plan: CPPlan | LayerPlans | None = None) -> torch.Tensor:
        """tokens ``[B, n]`` (this rank's slice in the CP layout); position_ids ``[B, n]`` global positions
        (None: those of the layout; restarting at each document is fine); labels ``[B, n]`` global class ids
        (``-100``: ignored, loss 0); document_ids ``[B, n]`` the tokens' documents, non-decreasing along each
        sample (None: one document per sample): attention stays inside each document. ``plan``: this
        batch's ``build_cp_plan`` when the caller built it already (the full layers'; the plans of sliding-window
        layers are built here, ``layer_plans``), or the loader's ``LayerPlans`` of every window.

        Returns the per-token loss ``[B, n]`` (fp32) with labels, else logits ``[B, n, vocab/tp]``.
        """
        self._check_inputs(tokens, position_ids, labels, document_ids)
        batch, n = tokens.shape
        if plan is None:
            plan = self.build_cp_plan(n, document_ids, position_ids)
        plans = self.layer_plans(n, document_ids, position_ids, plan, tokens.device)
        self.layer_pairs = self.mean_layer_pairs(plans)
        if position_ids is None:
            position_ids = self.local_positions(n, tokens.device)
        position_ids = position_ids.expand(batch, n)
        config = self.config
        cos, sin = rope_tables(position_ids, config.head_dim, config.rope_theta, scaling=config.rope_scaling,
                               max_position_embeddings=config.max_position_embeddings)
        x = self.embedding(tokens)
        handles = {window: plan_handle(self.parallel.cp, attention_spec(config, self.parallel, x.device,
                                                                        compute_dtype(x), batch, p), p)
                   for window, p in plans.items()}
        inputs = BlockInputs(cos, sin, handles[None], handles)
        for layer in self.layers:
            x = layer(x, inputs)
        if labels is None:
            return self._logits(x)
        return self._head_loss(x, labels)

    def _head_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final norm's output (in the TP region: with sequence parallelism, gathered from the shards) and the
        head's weight (the embedding's when tied)."""
        group = self.parallel.tp_group
        if self.parallel.sequence_parallel:
            x = gather_from_sequence_parallel_region(sequence_parallel_norm(self.norm, x, group), group)
        else:
            x = copy_to_tensor_parallel_region(self.norm(x), group)
        return x, self.embedding.weight if self.lm_head is None else self.lm_head.weight

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(*self._head_input(x))

    def _head_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunk = self.config.loss_chunk_tokens
        if not chunk:
            return vocab_parallel_cross_entropy(self._logits(x), labels, self.parallel.tp_group)
        x, weight = self._head_input(x)
        return linear_cross_entropy(x.flatten(0, 1), weight, labels, self.parallel.tp_group, chunk)

    def compile_parts(self, fullgraph: bool = True) -> list[str]:
        """``torch.compile`` each block's computation (inside its FSDP hooks and its activation checkpoint) and
        the head with its loss, in place; the embedding, the RoPE tables and the CP plan stay eager. Returns
        the names of what was compiled. A new CP plan is a new value of the attention handle (``BlockInputs``),
        not a recompile."""
        # each compiled part is smaller than a DDP bucket: Dynamo's DDP graph splitting would only add breaks
        torch._dynamo.config.optimize_ddp = False
        for layer in self.layers:
            layer.compile_forward(fullgraph)
        self._head_loss = torch.compile(self._head_loss, fullgraph=fullgraph)
        self.compiled_parts = [f"blocks 0-{len(self.layers) - 1}", "head+loss"]
        return self.compiled_parts
