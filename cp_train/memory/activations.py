"""An estimate of the activation memory of one training micro-batch per rank (``train.py --dry-run``).

The estimate counts the tensors autograd keeps for the backward, term by term, for the model's shapes on one
rank: ``n = micro_batch * seq_len / cp`` tokens, ``heads / tp`` query and ``kv_heads / tp`` kv heads, ``ffn /
tp`` and ``vocab / tp`` columns. ``compute`` is the matmul input dtype's size (2 in bf16), ``residual`` the
residual stream's (4 under autocast with fp32 weights, 2 with FSDP's bf16 weights). Per block without
activation checkpointing: the two RMSNorm inputs (residual), the matmul inputs (compute; under autocast each
linear casts its own copy), the fused QKV output (RoPE keeps views of it), roped q and k, v, the attention
output and its fp32 log-sum-exp, and the SwiGLU's gate, up, silu and product ``[n, ffn/tp]`` (unless
``mlp_chunks`` > 1, which keeps only the MLP's input and recomputes one slice at a time; not inside a
checkpointed block, whose recompute keeps every slice's). With activation checkpointing a block keeps its
input only and one block is recomputed during the backward. The head keeps the final norm's input, its matmul
input and, with full logits (``model.loss_chunk_tokens`` 0), the fp32 softmax ``[n, vocab/tp]`` of the cross
entropy (fused by chunks: two fp32 numbers per token); its peak (the logits, or one chunk of them) and the
backward's working buffers (one block's, or the head's) come on top.

The peak is ``blocks + max(head peak, recomputed block + its backward buffers)``: an estimate, good to the
tens of percent (``bench/activations.py`` compares it with the measured peak of one block).
"""

from __future__ import annotations

from dataclasses import dataclass

from cp_train.model.config import ModelConfig


@dataclass(frozen=True)
class Shapes:
    """One rank's activation shapes: ``n`` tokens, per-rank heads, kv heads, ffn and vocab, and dtype sizes."""

    n: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    compute: int  # bytes per element of the matmul inputs and outputs
    residual: int  # bytes per element of the residual stream
    autocast: bool  # True: fp32 weights under autocast (each linear keeps its own cast input)
    ring: bool = False  # cp > 1: the attention's backward keeps fp32 dK/dV accumulators that travel the ring


def shapes_of(model: ModelConfig, tokens: int, tp: int, cp: int, compute: int, residual: int,
              autocast: bool) -> Shapes:
    return Shapes(tokens, model.hidden_size, model.num_heads // tp, model.num_kv_heads // tp, model.head_dim,
                  model.ffn_hidden_size // tp, model.vocab_size // tp, compute, residual, autocast, cp > 1)


def attention_saved(s: Shapes) -> int:
    """Bytes the attention half of a block keeps: norm input, QKV input and output, roped q/k, v, out, lse."""
    qkv = s.n * (s.heads + 2 * s.kv_heads) * s.head_dim * s.compute
    roped = s.n * (s.heads + s.kv_heads) * s.head_dim * s.compute
    v = s.n * s.kv_heads * s.head_dim * s.compute
    out = s.n * s.heads * s.head_dim * s.compute + s.n * s.heads * 4
    norm_and_input = s.n * s.hidden * (s.residual + s.compute)  # the norm's input, the QKV matmul's input
    return norm_and_input + qkv + roped + v + out


def mlp_saved(s: Shapes, chunks: int) -> int:
    """Bytes the MLP half keeps: norm input, the matmul inputs, and gate, up, silu and product (unchunked)."""
    norm = s.n * s.hidden * s.residual
    inputs = (2 if s.autocast else 1) * s.n * s.hidden * s.compute
    if chunks > 1:  # each slice is checkpointed: only the MLP's input (the norm's output) stays
        return norm + s.n * s.hidden * s.residual
    return norm + inputs + 4 * s.n * s.ffn * s.compute


def block_backward_buffers(s: Shapes, chunks: int) -> int:
    """The largest working set of a block's backward: the MLP's activation gradients (two ``[n, ffn/tp]`` more
    than it keeps; one slice's recompute and gradients when chunked), or the attention's (the output's
    gradient, dq, dk, dv and the residual's gradient; on a ring also fp32 dK/dV accumulators)."""
    slice_tokens = -(-s.n // max(chunks, 1))
    mlp = (4 if chunks > 1 else 0) * slice_tokens * s.ffn * s.compute + 2 * slice_tokens * s.ffn * s.compute
    attention = s.n * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.compute + s.n * s.hidden * s.residual
    if s.ring:
        attention += 2 * s.n * s.kv_heads * s.head_dim * 4
    return max(mlp, attention)


def head_saved(s: Shapes, chunk: int = 0) -> int:
    """Bytes the final norm, the head's matmul and the cross entropy keep: with the full logits (``chunk``
    0) the fp32 softmax ``[n, vocab/tp]``; fused by chunks, the row max and log-sum-exp, fp32 ``[n]`` each."""
    inputs = s.n * s.hidden * s.residual + s.n * s.hidden * s.compute
    return inputs + (2 * s.n * 4 if chunk else s.n * s.vocab * 4)


def head_peak(s: Shapes, chunk: int = 0) -> int:
    """The head's transient on top of what it keeps. Full logits: the logits in the compute dtype (forward),
    or the gradient's copy in that dtype (backward). Fused by chunks (``fused_loss.py``): one chunk's logits
    in fp32 and the compute dtype, plus the backward's fp32 ``dx`` ``[n, hidden]`` and ``dweight``
    ``[vocab/tp, hidden]``."""
    if not chunk:
        return s.n * s.vocab * s.compute
    return min(chunk, s.n) * s.vocab * (4 + s.compute) + 4 * s.hidden * (s.n + s.vocab)


def block_peak(s: Shapes, chunks: int) -> int:
    """One block's forward + backward on its own (what ``bench/memory.py`` measures): what it keeps, its
    output and its backward buffers."""
    return attention_saved(s) + mlp_saved(s, chunks) + s.n * s.hidden * s.residual + block_backward_buffers(s, chunks)


def activation_estimate(model: ModelConfig, tokens: int, tp: int, cp: int, compute: int, residual: int,
                        autocast: bool) -> dict[str, int]:
    """Bytes per rank: ``blocks`` (kept by all blocks), ``head``, ``backward`` (the recomputed block with
    activation checkpointing plus a block's backward buffers, or the head's peak) and their sum ``peak``;
    ``tokens`` is this rank's (micro batch x seq_len / cp)."""
    s = shapes_of(model, tokens, tp, cp, compute, residual, autocast)
    mode = model.activation_checkpointing
    # inside a checkpointed block the MLP slices are not checkpointed again (``model/mlp.py``): the recompute
    # keeps every slice's intermediates
    block = attention_saved(s) + mlp_saved(s, model.mlp_chunks if mode == "none" else 1)
    block_input = s.n * s.hidden * s.residual
    if mode == "none":
        kept, recompute = block, 0
    elif mode == "full":
        kept, recompute = block_input, block
    else:  # selective: the CP attention keeps q, k, v, its output and lse; either side of it is recomputed
        attention_kept = s.n * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.compute + s.n * s.heads * 4
        kept = block_input + attention_kept
        recompute = max(attention_saved(s) - attention_kept, mlp_saved(s, 1) + block_input)
    chunk = model.loss_chunk_tokens
    backward = max(head_peak(s, chunk), recompute + block_backward_buffers(s, model.mlp_chunks))
    out = {"blocks": model.num_layers * kept, "head": head_saved(s, chunk), "backward": backward, "block": block}
    out["peak"] = out["blocks"] + out["head"] + out["backward"]
    return out
