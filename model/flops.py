"""Model FLOPs per token of a training step (forward + backward), for TFLOP/s and MFU.

Megatron / PaLM convention, per token at global sequence length ``s``:

    flops = 6 * N + 6 * L * (heads * head_dim) * s

- ``N`` counts the weights of the matmuls only: per layer the fused QKV projection
  ``hidden * (heads + 2*kv_heads) * head_dim``, the output projection ``heads*head_dim * hidden``
  and the SwiGLU MLP ``3 * hidden * ffn``; plus the LM head ``hidden * vocab`` (counted even
  when tied, since the matmul runs). Embedding lookups, norms, RoPE, activations and the
  loss are not counted. Each weight costs 2 FLOPs per token forward and 4 backward: ``6 * N``.
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

from cp_train.model.config import ModelConfig


def matmul_params(config: ModelConfig) -> int:
    """``N``: weights that take part in a matmul per token (see the module docstring)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * (config.num_heads + 2 * config.num_kv_heads) * head_dim
    attention += config.num_heads * head_dim * hidden
    mlp = 3 * hidden * config.ffn_hidden_size
    return config.num_layers * (attention + mlp) + hidden * config.vocab_size


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
