"""The GPT model's configuration and its checks against a parallel layout."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from cp_train.model.hf.rope_scaling import resolve_rope_scaling
from cp_train.parallel.cp.layout_names import check_layout, check_layout_name
from cp_train.parallel.kernels.backends import BACKENDS

OFFLOAD_MODES = ("none", "checkpointed", "all")  # model.activation_offload (parallel/offload.py)
LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names of a layer's attention
CHECKPOINTING = ("none", "selective", "full")  # model.activation_checkpointing: what a block recomputes
NORMS = ("auto", "torch", "apex")  # model.norm: which RMSNorm module the blocks and the final norm use


@dataclass
class ModelConfig:
    """Shape and options of a Llama-style GPT decoder (RMSNorm, RoPE, GQA, SwiGLU), with the attention options of
    Mistral, Qwen2, Qwen3 and granite_swa / gpt-oss.

    Attention options: ``head_dim`` (None: hidden / heads; may differ from it); ``qkv_bias`` (q, k, v biased,
    o not: Qwen2); ``attention_bias`` (q, k, v and o biased); ``qk_norm`` (an RMSNorm over head_dim per head of
    q and k, after the projection and before RoPE: Qwen3); ``layer_types`` (per layer ``full_attention`` or
    ``sliding_attention``; None: every layer sliding when ``sliding_window`` is set, else full);
    ``sliding_window`` W (HF's: a query sees W keys, itself included); ``attention_sinks`` (one learned logit per
    query head and layer joining the softmax's denominator, initialised normal(0, ``init_std``) as gpt-oss does).
    ``hf_architecture``: the Hugging Face class the model came from (None: the simplest that represents it),
    which an export writes.

    ``mlp_chunks``: the MLP runs over this many slices of the local sequence, each under
    activation checkpointing (1: one plain pass). ``loss_chunk_tokens``: the LM head and its cross entropy
    run fused this many tokens at a time, never holding the ``[tokens, vocab]`` logits
    (``cp_train.parallel.tp.fused_loss``); 0: the full logits. ``activation_checkpointing``: ``full``
    recomputes each block in the backward, ``selective`` all of it but the CP attention, ``none`` nothing
    (the CP layout and algorithm are parallelism settings: ``ModelParallel``).
    ``attention_kernel``: kernel for the attention (None: the best available, see
    ``cp_train.parallel.kernels.select``; also used without a CP group).
    ``seed`` alone fixes the initial weights, whatever the layout. ``rope_scaling``: RoPE scaling
    with Hugging Face's fields and semantics (``linear``, ``llama3``, ``yarn``; see ``rope.py``),
    None for none; ``norm_eps`` is HF's ``rms_norm_eps``. ``norm``: the RMSNorm implementation
    (``auto``: apex's ``FusedRMSNorm`` when importable and the model is built for CUDA, else torch's
    ``nn.RMSNorm``; ``torch``; ``apex``: apex's, an error when it cannot be imported); see ``block.rms_norm``.
    """

    vocab_size: int = 32000
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    num_kv_heads: int | None = None  # None: num_heads (no GQA)
    ffn_hidden_size: int | None = None  # None: the multiple of 64 nearest 8/3 * hidden
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-5
    norm: str = "auto"
    tie_embeddings: bool = False
    mlp_chunks: int = 1
    loss_chunk_tokens: int = 1024  # the head and its loss this many tokens at a time (0: full logits)
    activation_checkpointing: str = "none"  # none | selective | full (true: full, false: none)
    # none | checkpointed | all: what the blocks save for the backward goes to host memory and comes back a layer
    # ahead (parallel/offload.py); checkpointed: what activation checkpointing keeps, all: also without it
    activation_offload: str = "none"
    attention_kernel: str | None = None
    init_std: float = 0.02
    seed: int = 1234
    head_dim: int | None = None  # None: hidden_size // num_heads
    qkv_bias: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention_sinks: bool = False
    hf_architecture: str | None = None
    family: str = "llama"  # what the trainer builds (model/family.py: llama is GPTModel; others registered)
    fp8: str = "none"  # none | tensorwise | rowwise: the blocks' linears in FP8 with torchao (parallel/tp/fp8.py)
    # with fp8: the first and last blocks whose linears stay in the compute dtype (Megatron's
    # --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16), where FP8's range costs the most accuracy
    fp8_bf16_layers_at_start: int = 0
    fp8_bf16_layers_at_end: int = 0
    # with fp8: the FP8 GEMMs that accumulate fast (Hopper's fast accumulation: fewer promotions of the partial
    # sums to fp32, faster and less exact over long sums): output (torchao's recipes) | all (the backward's grad
    # input and grad weight GEMMs too) | none
    fp8_fast_accum: str = "output"

    def __post_init__(self) -> None:
        self.resolve()

    def resolve(self) -> None:
        """Fill the derived defaults left as None (``num_kv_heads``, ``ffn_hidden_size``, ``head_dim``) and spell
        ``activation_checkpointing`` as a mode (true: full, false: none); idempotent."""
        mode = str(self.activation_checkpointing).lower()
        if mode in ("true", "false"):
            self.activation_checkpointing = "full" if mode == "true" else "none"
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 64 * max(1, round(8 * self.hidden_size / 3 / 64))
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_heads, int) \
                and self.num_heads > 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window W of layer ``layer`` (None: full causal attention)."""
        kinds = self.layer_types
        sliding = kinds[layer] == "sliding_attention" if kinds is not None else self.sliding_window is not None
        return self.sliding_window if sliding else None

    @property
    def windows(self) -> list[int | None]:
        """Every layer's sliding window (None: full attention)."""
        return [self.layer_window(i) for i in range(self.num_layers)]

    @property
    def blocks_under_fp8(self) -> range:
        """The blocks FP8 computes the linears of when it is on: all but the first ``fp8_bf16_layers_at_start``
        and the last ``fp8_bf16_layers_at_end`` (the planner's ``--precision fp8`` plans them)."""
        return range(self.fp8_bf16_layers_at_start, self.num_layers - self.fp8_bf16_layers_at_end)

    @property
    def fp8_blocks(self) -> range:
        """The blocks whose linears compute in FP8 (``parallel/tp/fp8.py``): none without ``fp8``, else
        ``blocks_under_fp8``."""
        return range(0) if self.fp8 == "none" else self.blocks_under_fp8

    @property
    def has_bias(self) -> tuple[bool, bool]:
        """Whether the fused q/k/v projection and the output projection have biases."""
        return self.qkv_bias or self.attention_bias, self.attention_bias

    def check_attention_options(self) -> None:
        """Raise ``ValueError`` naming the field when the attention options do not describe a model."""
        for name in ("qkv_bias", "attention_bias", "qk_norm", "attention_sinks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2 \
                or self.head_dim % 2:
            raise ValueError(f"head_dim must be an even integer >= 2 for RoPE, got {self.head_dim!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 (keys a query sees, itself included) or "
                             f"null, got {window!r}")
        kinds = self.layer_types
        if kinds is not None:
            if len(kinds) != self.num_layers:
                raise ValueError(f"layer_types has {len(kinds)} entries for num_layers = {self.num_layers}: give one "
                                 f"per layer")
            unknown = sorted({str(k) for k in kinds} - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types: unknown {', '.join(unknown)}; each is one of {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in kinds and window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is null: set it")

    def check_fp8_layers(self) -> None:
        """Raise ``ValueError`` unless the blocks kept out of FP8 are counts >= 0 that leave FP8 some block."""
        start, end = self.fp8_bf16_layers_at_start, self.fp8_bf16_layers_at_end
        for name, value in (("fp8_bf16_layers_at_start", start), ("fp8_bf16_layers_at_end", end)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.fp8 != "none" and not self.blocks_under_fp8:
            raise ValueError(f"fp8_bf16_layers_at_start {start} + fp8_bf16_layers_at_end {end} keep all "
                             f"{self.num_layers} blocks out of FP8: lower them, or set fp8=none")

    def validate(self, tp: int = 1, cp: int = 1, seq_len: int | None = None, layout: str = "zigzag") -> None:
        """Raise ``ValueError`` saying what to change when this model cannot run at (tp, cp).

        ``seq_len`` (global tokens per sample), when given, is checked against the layout too.
        """
        positive = ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                    "ffn_hidden_size", "max_position_embeddings", "mlp_chunks")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, size in (("tp", tp), ("cp", cp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing must be one of {', '.join(CHECKPOINTING)} (or true/false), "
                             f"got {self.activation_checkpointing!r}")
        if self.activation_offload not in OFFLOAD_MODES:
            raise ValueError(f"activation_offload must be one of {', '.join(OFFLOAD_MODES)}, got "
                             f"{self.activation_offload!r}")
        if self.activation_offload == "checkpointed" and self.activation_checkpointing == "none":
            raise ValueError("activation_offload checkpointed moves what activation checkpointing keeps, and "
                             "activation_checkpointing is none: set it to selective or full, or offload all")
        self.check_fp8_layers()
        if isinstance(self.loss_chunk_tokens, bool) or not isinstance(self.loss_chunk_tokens, int) \
                or self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be an integer >= 0 (0: full logits), got "
                             f"{self.loss_chunk_tokens!r}")
        if not self.rope_theta > 1:
            raise ValueError(f"rope_theta must be > 1, got {self.rope_theta}")
        resolve_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        explicit = self.head_dim is not None and self.head_dim != self.hidden_size // heads
        if not explicit and self.hidden_size % heads != 0:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {heads}; "
                             f"make hidden_size a multiple of num_heads or set head_dim")
        if not explicit and self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = hidden_size / num_heads = {self.head_dim} must be even for RoPE; "
                             f"change hidden_size or num_heads")
        self.check_attention_options()
        if heads % kv_heads != 0:
            raise ValueError(f"num_heads {heads} is not divisible by num_kv_heads {kv_heads}; "
                             f"num_kv_heads must divide num_heads")
        for name, value in (("num_heads", heads), ("num_kv_heads", kv_heads), ("vocab_size", self.vocab_size),
                            ("ffn_hidden_size", self.ffn_hidden_size)):
            if value % tp != 0:
                raise ValueError(f"{name} {value} is not divisible by tp = {tp}; "
                                 f"choose a tp that divides {value} or make {name} a multiple of {tp}")
        block = gate_up_block(self.ffn_hidden_size)  # the MLP's gate/up blocks (``model/mlp.py``) stay whole
        if (self.ffn_hidden_size // block) % tp:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} alternates gate and up in "
                             f"{self.ffn_hidden_size // block} blocks of {block} rows, not divisible by tp = {tp}; "
                             f"make ffn_hidden_size a multiple of {512 * tp} or change tp")
        check_layout_name(layout)
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if self.attention_kernel is not None and self.attention_kernel not in BACKENDS:
            raise ValueError(f"unknown attention_kernel {self.attention_kernel!r}; choose one of "
                             f"{', '.join(BACKENDS)} or None")
        if seq_len is not None:
            self.check_sequence(seq_len, cp, layout)

    def check_sequence(self, seq_len: int, cp: int, layout: str = "zigzag") -> None:
        """Raise ``ValueError`` unless ``seq_len`` global tokens split evenly over ``cp`` ranks in ``layout``."""
        if cp > 1:  # at cp = 1 every layout is the whole sequence
            check_layout(seq_len, cp, layout)
        if seq_len > self.max_position_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}; raise max_position_embeddings")


def gate_up_block(ffn: int) -> int:
    """Rows per block of the fused gate/up weight (``ffn`` the full MLP width): the largest divisor of ``ffn / 8``
    up to 64, so ``ffn / block`` is a multiple of 8 (every tp up to 8 that divides ffn holds whole blocks); 1 when
    ffn is no multiple of 8."""
    if ffn % 8:
        return 1
    return max(block for block in range(1, 65) if (ffn // 8) % block == 0)


def param_seed(seed: int, name: str) -> int:
    """A stable seed for the parameter called ``name`` (same in every process and every layout)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)
