"""An estimate of the activation memory of one training micro-batch per rank (``train.py --dry-run``).

The estimate counts the tensors autograd keeps for the backward, term by term, for the model's shapes on one
rank: ``n = micro_batch * seq_len / cp`` tokens, ``heads / tp`` query and ``kv_heads / tp`` kv heads, ``ffn /
tp`` and ``vocab / tp`` columns. ``compute`` is the matmul input dtype's size (2 in bf16), ``residual`` the
residual stream's (4 under autocast with fp32 weights, 2 with FSDP's bf16 weights).

Per block without activation checkpointing: the residual stream (the block's input and the stream between
attention and MLP), what each RMSNorm keeps besides its input (on CPU its normalised input; CUDA's fused
kernels keep only a per-token scale), the inputs of the column-parallel matmuls (under autocast a cast copy each;
gate and up are one matmul), the CP attention's q, k, v, output and fp32 log-sum-exp (Ulysses also keeps its
sequence-ordered copies of them for its heads), and the SwiGLU's gate, up and product ``[n, ffn/tp]`` (silu is
recomputed: ``swiglu`` and ``gated_silu`` in ``model/mlp.py``) (unless ``mlp_chunks`` > 1, which keeps only the
MLP's input; not inside a checkpointed block). FP8 linears run eager (``model.fp8``) keep, under tensorwise,
FP8 casts of their inputs (1 byte; the output projection's besides the attention's output) in place of the inputs
(``fp8_inputs``); compiled, neither recipe keeps them (cast again in the backward). With sequence
parallelism (tp > 1) the residual stream and the norms hold ``n / tp`` tokens; the all-gathered inputs of the
column-parallel matmuls (QKV, gate/up, head) hold all ``n``. ``full`` checkpointing keeps each block's input
(``n / tp`` tokens under SP) and recomputes one block in the backward; ``selective`` keeps the input and what
the CP attention keeps, and recomputes either side of it (compiled, the attention's q, k, v as well: Inductor's
partition recomputes a checkpoint's outputs).

The head keeps the final norm's input and the head's matmul input and, with full logits
(``model.loss_chunk_tokens`` 0), the fp32 softmax ``[n, vocab/tp]``; fused by chunks, two fp32 numbers per token.

Two moments of the backward compete for the peak (``activation_estimate`` gives both; ``dry_run.py`` adds the
transient parameter and gradient copies of each and takes the larger): the head's backward, with every block's
tensors kept (one chunk's logits, the head's fp32 weight gradient and its matmul's product, ``dx``), and a block's
backward (the recomputed block, then the MLP's gradients, or the attention's with the CP algorithm's buffers of
``attention_buffers`` once the MLP half is freed).
The CP attention (``attention_kept``, ``attention_buffers``): every algorithm's operator keeps q, k, v, its
output and fp32 lse (``parallel/cp/op.py``); the algorithm reports what it keeps beyond that and its transient
working set (``CPAlgorithm.kept_bytes`` and ``buffer_bytes``: the ring's blocks in flight and fp32 dK/dV
accumulators, the all-gather's gathered chunks, Ulysses' all-to-all buffers and sequence-ordered copies); here
the parts every algorithm has, the output accumulator (forward) or the incoming gradient (backward), and one
rank's local kernel (on CPU K/V repeated to every query head, GQA, and their gradients too).
Checked against the measured peak of real training steps by ``bench/dry_run_check.py``.

With ``model.activation_offload`` the blocks' term is what stays on the device and a block's backward holds the
prefetched block on top (``offload.py``, which also counts the host bytes).
"""

from __future__ import annotations

from dataclasses import replace

from cp_train.memory.offload import device_terms, offload_plan
from cp_train.model.config import ModelConfig
from cp_train.parallel.cp.algorithms.costs import ACC, Shapes, expanded
from cp_train.parallel.cp.algorithms.registry import CPAlgorithm, get_cp_algorithm


def shapes_of(model: ModelConfig, tokens: int, tp: int, cp: int, compute: int, residual: int,
              algorithm: CPAlgorithm | None = None, ulysses: int = 1, sequence_parallel: bool = False,
              cuda: bool = False, compiled: bool = False, fp8_keeps: str | None = None) -> Shapes:
    """``Shapes`` for ``tokens`` per rank of ``model`` at (tp, cp) with the CP ``algorithm`` (None: ring);
    ``ulysses``: hybrid's ulysses_size; ``compiled``: ``train.compile``; ``fp8_keeps``: what FP8 linears keep of
    their inputs when not this project's (``Shapes.fp8_inputs``; None: ``fp8_inputs``)."""
    algorithm = algorithm or get_cp_algorithm("ring")
    degree = algorithm.head_degree(cp, ulysses) if cp > 1 else 1
    return Shapes(tokens, model.hidden_size, model.num_heads // tp, model.num_kv_heads // tp, model.head_dim,
                  model.ffn_hidden_size // tp, model.vocab_size // tp, compute, residual, cp,
                  algorithm, degree, tp, sequence_parallel and tp > 1, cuda,
                  swiglu_temporaries(model.fp8 != "none", compiled), fp8_keeps or fp8_inputs(model.fp8, compiled),
                  compiled)


def fp8_inputs(recipe: str, compiled: bool) -> str:
    """What this project's FP8 linears of ``recipe`` keep of their inputs (and weights) for the backward
    (``Shapes.fp8_inputs``). Eager, tensorwise keeps the FP8 casts ("fp8": ``Float8Matmul`` casts once) and
    rowwise the inputs ("kept"; torchao casts per GEMM). Compiled, either recipe keeps nothing ("recomputed"):
    Inductor's partition (AOTAutograd's min-cut) casts them again in the backward from what the block keeps anyway
    (its input and the norms' scales, the gate/up output) and saved scales, where bf16 linears keep the QKV,
    gate/up and down inputs and autocast's weight copies (read off the partitioned graphs of a 1B block on CPU; on
    an H200, 2026-11-30, the 1B step at 16k kept 9.3 GiB less under FP8, where these come to 9.2 GiB).
    The planner plans its published Transformer Engine runs' FP8 linears as bf16 ones ("bf16", ``fp8_keeps``)."""
    if recipe == "none":
        return "kept"
    if compiled:
        return "recomputed"
    return "fp8" if recipe == "tensorwise" else "kept"


def swiglu_temporaries(fp8: bool, compiled: bool) -> int:
    """The ``[n, ffn/tp]`` tensors the SwiGLU's backward holds beside what it keeps and its incoming gradient
    (``model/mlp.py``): eager, the ``swiglu`` node writes both gradients over its saved output with one temporary
    (1); compiled, ``gated_silu``'s one kernel writes the two gradients side by side (2; inside a checkpoint the
    plain expression, whose backward Inductor fuses alike); FP8 eager,
    ``gated_silu``'s operations one by one (grad * up, both gradients, then their stack: 4)."""
    if compiled:
        return 2
    return 4 if fp8 else 1


def _qkv_elements(s: Shapes) -> int:
    """Elements of the attention's q, k and v on this rank."""
    return s.n * (s.heads + 2 * s.kv_heads) * s.head_dim


def attention_kept(s: Shapes) -> int:
    """What the CP attention keeps for the backward: q, k, v, output and fp32 lse (and its algorithm's own)."""
    io = (_qkv_elements(s) + s.n * s.heads * s.head_dim) * s.compute + s.n * s.heads * ACC
    return io + (s.algorithm.kept_bytes(s) if s.cp > 1 else 0)


def attention_buffers(s: Shapes, backward: bool) -> int:
    """The CP attention's transient working set in its forward or ``backward`` beyond what it keeps, with the
    incoming gradient and the dq, dk, dv it returns."""
    d, c = s.head_dim, s.compute
    if not backward:
        out = s.n * s.heads * (d + 1) * ACC if c < ACC else 0  # the fp32 output accumulator before its cast
    else:  # dout
        out = s.n * s.heads * d * c
    if s.cp == 1:  # the kernel's dq, dk, dv
        return out + (_qkv_elements(s) * c if backward else 0) + expanded(s, s.n, s.heads, s.kv_heads, backward)
    return out + s.algorithm.buffer_bytes(s, backward)


def _stream(s: Shapes) -> int:
    return s.stream * s.hidden * s.residual


def norm_kept(s: Shapes) -> int:
    """What one RMSNorm keeps besides its input: the normalised input on CPU (its composite form)."""
    return s.stream * 4 if s.cuda else _stream(s)


def linear_input(s: Shapes) -> int:
    """Bytes per element a linear keeps of its input (``Shapes.fp8_inputs``): the compute dtype's (the input itself,
    or autocast's copy), 1 (an FP8 cast; the input is freed unless kept else) or 0 (cast again in the backward)."""
    return {"kept": s.compute, "bf16": s.compute, "fp8": 1, "recomputed": 0}[s.fp8_inputs]


def rope_copies(s: Shapes) -> int:
    """A block's own casts of the rope tables to the compute dtype, cos and sin ``[n, head_dim / 2]`` each (none in
    fp32: the tables are shared): kept by ``apply_rope``'s products, eager once for q and once for k, compiled once
    (Inductor's partition keeps one of each)."""
    return s.n * s.head_dim * s.compute * (1 if s.compiled else 2) if s.compute < 4 else 0


def mid_stream(s: Shapes) -> int:
    """The stream between the attention and the MLP, which the MLP's norm needs: eager, the residual sum itself;
    compiled, the output projection's output in the compute dtype (Inductor's partition adds the block's input,
    kept anyway, to it again in the backward)."""
    return s.stream * s.hidden * min(s.residual, s.compute) if s.compiled else _stream(s)


def attention_half(s: Shapes) -> int:
    """The attention half of a block without checkpointing: the block's input, the norm, the QKV input (all ``n``
    tokens, gathered under SP) and what the attention keeps (its output is the output projection's input; an FP8
    projection that keeps FP8 casts keeps one of it besides) and the rope tables' casts."""
    fp8_copy = s.n * s.heads * s.head_dim if s.fp8_inputs == "fp8" else 0
    return (_stream(s) + norm_kept(s) + s.n * s.hidden * linear_input(s) + attention_kept(s) + fp8_copy
            + rope_copies(s))


def mlp_half(s: Shapes, chunks: int) -> int:
    """The MLP half: the stream after attention (``mid_stream``), the norm, the gate/up input (one matmul) and
    gate, up and product ``[n, ffn/tp]`` (``model/mlp.py``'s ``swiglu`` eager, ``gated_silu`` compiled and under
    FP8: silu recomputed; the product is the down projection's input, ``linear_input``); chunked (``chunks`` > 1)
    only the MLP's input."""
    if chunks > 1:
        return _stream(s) + norm_kept(s) + s.n * s.hidden * s.residual
    intermediates = 2 * s.n * s.ffn * s.compute + s.n * s.ffn * linear_input(s)
    return mid_stream(s) + norm_kept(s) + s.n * s.hidden * linear_input(s) + intermediates


def mlp_backward(s: Shapes, chunks: int) -> int:
    """The MLP's backward on top of what it keeps (freed as its nodes run): the SwiGLU backward's temporaries
    ``[n, ffn/tp]`` (``swiglu_temporaries``; the down projection's input is freed as its gradient comes);
    chunked, one slice's recompute (gate, up and product) and temporaries."""
    slice_tokens = -(-s.n // max(chunks, 1))
    return ((3 if chunks > 1 else 0) + s.swiglu_temps) * slice_tokens * s.ffn * s.compute


def block_backward(s: Shapes, chunks: int, recomputed: int) -> int:
    """A block's backward on top of the blocks' kept tensors: the stream's incoming gradient, and the larger of
    the MLP's backward (``recomputed``: what the checkpoint recomputed, if any) and the attention's, which runs
    once the MLP half's tensors are freed. ``chunks``: the MLP's slices in the backward."""
    mlp = recomputed + mlp_backward(s, chunks)
    attention = recomputed - mlp_half(s, chunks) + attention_buffers(s, backward=True)
    return _stream(s) + max(mlp, attention)


def head_kept(s: Shapes, chunk: int = 0) -> int:
    """The final norm's input and what it keeps, the head's input (all ``n`` tokens, gathered under SP) and
    the loss's: with the full logits (``chunk`` 0) the fp32 softmax ``[n, vocab/tp]``; fused by chunks, the row
    max and log-sum-exp, fp32 ``[n]`` each."""
    inputs = _stream(s) + norm_kept(s) + s.n * s.hidden * (s.residual if chunk else s.compute)
    return inputs + (2 * s.n * 4 if chunk else s.n * s.vocab * 4)


def head_peak(s: Shapes, chunk: int = 0) -> int:
    """The head's backward on top of what it keeps. Full logits: the logits' gradient in the compute dtype.
    Fused by chunks (``fused_loss.py``): one chunk's fp32 logits (and their compute-dtype copy in bf16), the
    fp32 ``dweight`` ``[vocab/tp, hidden]`` and the matmul's product added into it, and the fp32 ``dx``."""
    if not chunk:
        return s.n * s.vocab * s.compute
    rows = min(chunk, s.n)
    logits = rows * s.vocab * (4 + (s.compute if s.compute < 4 else 0))
    return logits + s.vocab * s.hidden * (4 + s.compute) + 4 * s.n * s.hidden


def block_peak(s: Shapes, chunks: int) -> int:
    """One block's forward + backward on its own (what ``bench/memory.py`` measures): what it keeps, its
    output and its backward."""
    return attention_half(s) + mlp_half(s, chunks) + _stream(s) + block_backward(s, chunks, 0)


def block_terms(model: ModelConfig, s: Shapes) -> tuple[int, int, int]:
    """``(block, kept, backward)`` of one block of ``model`` with shapes ``s``: its tensors without checkpointing,
    what it keeps under ``model.activation_checkpointing`` and its backward on top of the blocks' kept tensors."""
    mode = model.activation_checkpointing
    # inside a checkpointed block the MLP slices are not checkpointed again (``model/mlp.py``): the recompute
    # keeps every slice's intermediates
    chunks = model.mlp_chunks if mode == "none" else 1
    block = attention_half(s) + mlp_half(s, chunks)
    block_input = _stream(s)
    if mode == "none":
        return block, block, block_backward(s, chunks, 0)
    if mode == "full":  # the recompute runs the attention's forward again (its buffers) before the backward
        forward = attention_half(s) - block_input + attention_buffers(s, backward=False)
        return block, block_input, max(forward, block_backward(s, 1, block - block_input))
    # selective: the CP attention keeps its tensors; the MLP side, then the QKV side are recomputed. Compiled, its
    # q, k, v too: Inductor's partition recomputes a checkpoint's outputs (the QKV side's) for their users' backward
    recomputed_qkv = _qkv_elements(s) * s.compute if s.compiled else 0
    kept = block_input + attention_kept(s) - recomputed_qkv
    qkv_side = attention_half(s) - kept
    return block, kept, max(block_backward(s, 1, mlp_half(s, 1)),
                            _stream(s) + qkv_side + attention_buffers(s, True))


def activation_estimate(model: ModelConfig, s: Shapes) -> dict[str, int]:
    """Bytes per rank for shapes ``s`` of ``model``: ``blocks`` (kept by all blocks on the device), ``block_input``
    (one block's input), ``head`` (kept by the head and loss), ``head_backward`` (the head's backward on top),
    ``block_backward`` (a block's backward: the recomputed block with activation checkpointing and its working set;
    the head's tensors are freed by then) and ``block`` (one block without checkpointing); with
    ``model.activation_offload`` (``offload.py``) ``window`` (the prefetched blocks a block's backward holds on
    top), ``offloaded`` (host bytes), ``moved`` (bytes each way per micro-batch), ``moved_per_layer`` and
    ``offloaded_layers`` (all 0 without it)."""
    fp8 = len(model.fp8_blocks)  # the blocks whose linears compute in FP8 keep their inputs as ``s`` says
    plain = replace(s, fp8_inputs="kept")
    terms = [block_terms(model, plain)] * (model.num_layers - fp8) + [block_terms(model, s)] * fp8
    block, backward = max(t[0] for t in terms), max(t[2] for t in terms)
    chunk = model.loss_chunk_tokens
    plan = offload_plan(model, s, block)
    blocks, window = device_terms(plan, sum(t[1] for t in terms))
    return {"blocks": blocks, "block_input": _stream(s), "head": head_kept(s, chunk),
            "head_backward": head_peak(s, chunk), "block_backward": backward, "block": block, "window": window,
            "offloaded": plan.host_bytes if plan else 0, "moved": plan.traffic_bytes if plan else 0,
            "moved_per_layer": plan.per_layer if plan else 0, "offloaded_layers": plan.layers if plan else 0}
