"""Model families: what the trainer builds (``model.family``), and the arithmetic of its block, described once.

A ``ModelFamily`` builds the model (an ``nn.Module`` with ``GPTModel``'s contract: ``forward(tokens, labels=...)``,
``build_cp_plan``, ``sample_planner``, ``compile_parts``, the FSDP units) and describes one block's linear layers
(``block_linears``, unsharded, with how TP splits each) and its other weights, and the root's. Everything that
counts the model derives from that description: the weights (``parameter_count``; the planner's presets), the
model FLOPs per token (below: TFLOP/s, MFU, the planner), the planner's GEMMs per rank (``cp_train.perf.workload``).

The built-in ``llama`` family is ``GPTModel``: Llama, Mistral (sliding windows), Qwen2/2.5 (q/k/v biases), Qwen3
(q/k norms, an explicit head_dim) and granite_swa (attention sinks), by their ``ModelConfig`` options.
``register_model_family(name, family)`` adds one.

**Model FLOPs per token** of a training step (forward + backward), for TFLOP/s and MFU. Megatron / PaLM
convention, per token at global sequence length ``s``:

    flops = 6 * N + 6 * L * (heads * head_dim) * s

- ``N`` counts the weights of the matmuls only, as the model's family describes its block (Llama: per layer
  the fused QKV projection ``hidden * (heads + 2*kv_heads) * head_dim``, the output projection ``heads*head_dim *
  hidden`` and the SwiGLU MLP ``3 * hidden * ffn``); plus the LM head ``hidden * vocab`` (counted even when tied,
  since the matmul runs). Embedding lookups, biases, norms, RoPE, activations and the loss are not counted. Each
  weight costs 2 FLOPs per token forward and 4 backward: ``6 * N``.
- Attention scores ``Q K^T`` and ``P V`` cost ``4 * s * heads * head_dim`` per token per layer
  forward with every key visible, 3x that with the backward (``12 * L * h_attn * s``); causal
  masking halves it (each query sees ``s/2`` keys on average), giving ``6 * L * h_attn * s``.
- Packed documents with per-document masks: each query sees only its own document, so the attention
  term counts the query-key pairs the mask leaves (``attention_flops``), not ``s/2`` per token. Sliding-window
  layers count the keys their window leaves (``keys_per_query``).
- MODEL FLOPs: recomputation (activation checkpointing, the chunked MLP, flash attention's
  backward) is not counted, so MFU compares configurations fairly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cp_train.model.config import ModelConfig


@dataclass(frozen=True)
class Linear:
    """One linear layer of a block: ``in_features -> out_features`` (with a bias or not); ``split``: how tensor
    parallelism shards it, ``column`` (the outputs) or ``row`` (the inputs)."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    split: str

    def shard(self, tp: int) -> tuple[int, int]:
        """``(in, out)`` features on one of ``tp`` ranks."""
        if self.split == "column":
            return self.in_features, self.out_features // tp
        return self.in_features // tp, self.out_features


class ModelFamily:
    """One model family (see the module docstring). Subclasses set ``name`` and implement ``build``,
    ``block_linears``, ``block_other_weights``, ``head`` and ``root_weights``."""

    name: str = ""

    def build(self, config: ModelConfig, parallel: object = None, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
        """The model of ``config`` on ``parallel`` (a ``ModelParallel``; None: one rank)."""
        raise NotImplementedError

    def block_linears(self, config: ModelConfig) -> tuple[Linear, ...]:
        """One block's linear layers, unsharded, in the order they run."""
        raise NotImplementedError

    def block_other_weights(self, config: ModelConfig) -> int:
        """One block's weights outside its linear layers (norms, per-head parameters)."""
        raise NotImplementedError

    def head(self, config: ModelConfig) -> Linear:
        """The LM head's matmul (its FLOPs count even when its weight is tied to the embedding)."""
        raise NotImplementedError

    def root_weights(self, config: ModelConfig) -> int:
        """The weights outside the blocks: embedding, final norm, the head unless tied."""
        raise NotImplementedError

    def layer_parameters(self, config: ModelConfig) -> int:
        """Weights of one block, biases included."""
        linears = sum(x.in_features * x.out_features + (x.out_features if x.bias else 0)
                      for x in self.block_linears(config))
        return linears + self.block_other_weights(config)

    def parameter_count(self, config: ModelConfig) -> int:
        """Weights of the whole model as it builds them."""
        return config.num_layers * self.layer_parameters(config) + self.root_weights(config)

    def matmul_params(self, config: ModelConfig) -> int:
        """``N`` of the FLOP count: weights taking part in a matmul per token (the blocks' linears and the head)."""
        head = self.head(config)
        return (config.num_layers * sum(x.in_features * x.out_features for x in self.block_linears(config))
                + head.in_features * head.out_features)


class Llama(ModelFamily):
    """``GPTModel``: fused QKV, the output projection, a SwiGLU MLP (gate and up fused), two RMSNorms per block."""

    def build(self, config: ModelConfig, parallel: object = None, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
        from cp_train.model.gpt import GPTModel

        return GPTModel(config, parallel, device=device, dtype=dtype)

    def block_linears(self, config: ModelConfig) -> tuple[Linear, ...]:
        hidden, d, ffn = config.hidden_size, config.head_dim, config.ffn_hidden_size
        qkv_bias, out_bias = config.has_bias
        return (Linear("qkv", hidden, (config.num_heads + 2 * config.num_kv_heads) * d, qkv_bias, "column"),
                Linear("attention out", config.num_heads * d, hidden, out_bias, "row"),
                Linear("mlp gate+up", hidden, 2 * ffn, False, "column"),
                Linear("mlp down", ffn, hidden, False, "row"))

    def block_other_weights(self, config: ModelConfig) -> int:
        return (2 * config.hidden_size + (2 * config.head_dim if config.qk_norm else 0)
                + (config.num_heads if config.attention_sinks else 0))

    def head(self, config: ModelConfig) -> Linear:
        return Linear("lm head", config.hidden_size, config.vocab_size, False, "column")

    def root_weights(self, config: ModelConfig) -> int:
        return config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2) + config.hidden_size


_FAMILIES: dict[str, ModelFamily] = {"llama": Llama()}
_FAMILIES["llama"].name = "llama"


def register_model_family(name: str, family: ModelFamily) -> ModelFamily:
    """Make ``family`` the one ``model.family: name`` builds; returns it (a module listed in ``train.imports``
    registers it before the config is checked)."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_model_family({name!r}, ...) needs a ModelFamily, got {type(family).__name__}")
    family.name = name
    _FAMILIES[name] = family
    return family


def get_model_family(name: str) -> ModelFamily:
    """The family named ``name``; ``ValueError`` listing the families otherwise."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown model.family {name!r}; choose one of {', '.join(_FAMILIES)}, or register yours "
                         f"with register_model_family in a module listed in train.imports")
    return _FAMILIES[name]


def matmul_params(config: ModelConfig) -> int:
    """``N``: weights that take part in a matmul per token (see the FLOPs section of the module docstring)."""
    return get_model_family(config.family).matmul_params(config)


def keys_per_query(seq_len: int, window: int | None, causal: bool = True) -> float:
    """Keys a query sees on average in one sequence of ``seq_len`` tokens: ``seq_len / 2`` causal (the
    convention's half), ``seq_len`` counted in full; with a sliding ``window`` of ``W`` keys, the causal count is
    the window's exact pairs over the tokens and the full count ``min(W, seq_len)``."""
    if window is None or window >= seq_len:
        return seq_len / 2 if causal else float(seq_len)
    if not causal:
        return float(window)
    pairs = window * (window + 1) // 2 + (seq_len - window) * window  # rows 1..W, then W keys each
    return pairs / seq_len


def model_flops_per_token(config: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (fwd + bwd) per token at global sequence length ``seq_len``; independent of the layout.
    Sliding-window layers (``config.windows``) count the keys their window leaves (``keys_per_query``)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    keys = sum(keys_per_query(seq_len, window, causal) for window in config.windows)
    return 6.0 * matmul_params(config) + 12.0 * config.num_heads * config.head_dim * keys


def attention_flops(config: ModelConfig, pairs: float) -> float:
    """Training FLOPs (fwd + bwd) of attention over ``pairs`` visible query-key pairs (per head, all layers'
    shared mask): ``12 * L * heads * head_dim`` per pair."""
    return 12.0 * config.num_layers * config.num_heads * config.head_dim * pairs
