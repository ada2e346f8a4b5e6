"""What one rank computes and sends in one micro-batch of a layout: the planner's work list.

Everything is counted from the shapes the trainer runs and, for the CP attention, from the CP plan the
trainer executes (``cp_train.parallel.cp.plan``): every kernel call of every ring step (query rows x key
rows, causal or full) and the rows each hop carries, for the rank's layout and algorithm. Nothing here
knows a device: ``time_model.py`` turns the list into seconds.

Units: FLOPs, bytes, per rank, per micro-batch, forward only unless a name says backward. ``n`` is the
rank's tokens per sample (``seq_len / cp``), ``batch`` the micro-batch's samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cp_train.config.schema import Config
from cp_train.model.config import ModelConfig
from cp_train.model.family import get_model_family
from cp_train.parallel.cp.algorithms.costs import (
    PLAN_ROWS,
    AttentionStep,
    Collective,
    KernelCall,
    WorkInputs,
)
from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.parallel.cp.plan.batch_plan import layout_plan
from cp_train.perf.inputs.documents import consecutive_samples, document_pieces, search_rank_plans

__all__ = ["ATTENTION_BACKWARD", "AttentionStep", "Collective", "Gemm", "KernelCall", "Workload", "build_workload"]

ATTENTION_BACKWARD = 2.5  # flash attention's backward: five matmuls of the forward's size against two
# samples of packed documents the attention's time is the mean over at cp 1 (the trainer passes its first 16): one
# sample's documents alone misjudge it (the embedded corpus at 16k: the first sample's mask is 18% of a causal
# sample's, the first 16 samples' mean 36%)
TIME_SAMPLES = 16


def planned_samples(documents: tuple[int, ...], seq_len: int, cp: int) -> list[tuple[int, ...]]:
    """The samples of ``seq_len`` tokens packed from ``documents`` whose attention the planner times: at cp 1 the
    first ``TIME_SAMPLES`` (repeats kept); above it the one of them whose mask holds the nearest to their mean
    number of pairs, since every sample there costs a CP plan per algorithm and layout (all 16 made a search of
    llama3-8b on 8 GPUs 3x slower)."""
    samples = consecutive_samples(documents, seq_len, TIME_SAMPLES)
    if cp == 1:
        return samples
    pairs = [sum(piece * piece for piece in sample) for sample in samples]
    mean = sum(pairs) / len(pairs)
    return [samples[min(range(len(samples)), key=lambda i: abs(pairs[i] - mean))]]


@dataclass(frozen=True)
class Gemm:
    """``count`` forward matmuls ``[m, k] @ [k, n]`` per micro-batch (all layers); backward: two of each."""

    name: str
    m: int
    n: int
    k: int
    count: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass
class Workload:
    """One rank's micro-batch (see the module docstring); ``ranks`` holds every CP rank's attention steps."""

    config: Config
    n: int
    batch: int
    compute_bytes: int
    gemms: list[Gemm]
    head_gemm: Gemm
    attention: list[list[AttentionStep]]  # [cp rank][step]: the kernel calls and hop bytes of each step
    attention_heads: int  # local query heads a kernel call runs over
    attention_collectives: list[Collective]  # all-gather / all-to-all of the CP attention (per layer)
    tp_collectives: list[Collective]  # per layer
    tp_outside_collectives: list[Collective]  # per micro-batch, outside the blocks: embedding, head, loss
    elementwise_bytes: float  # memory traffic of the norms, residual adds, RoPE and SwiGLU, all layers, forward
    loss_bytes: float  # the cross entropy's memory traffic, forward
    accumulation: int  # micro-batches per optimizer step
    # with packed documents: ``attention`` of each sample ``planned_samples`` gives (the mean over them is timed);
    # ``attention`` is the first's
    attention_samples: tuple[list[list[AttentionStep]], ...] = ()


def _attention_steps(model: ModelConfig, config: Config, n: int, compute: int,
                     documents: tuple[int, ...] | None = None) -> tuple[list[list[AttentionStep]], int,
                                                                       list[Collective]]:
    """Every CP rank's attention steps (one layer, one sample), the local heads a call runs over and the
    attention's collectives per layer (per sample, scaled by the batch later): the algorithm's
    (``CPAlgorithm.attention_work``) from the plans the trainer runs, the local kernel's calls at cp 1.
    ``documents``: the lengths of the documents packed into each sample (``documents.py``; None: one document
    per sample)."""
    parallel = config.parallel
    tp, cp = parallel.tp, parallel.cp
    heads = model.num_heads // tp
    pieces = document_pieces(documents, n * cp) if documents else [n * cp]
    # the local kernel's calls over the whole sample: one varlen call over its documents when it holds several
    whole = tuple(KernelCall(c, c, True, len(pieces) > 1) for c in pieces)
    if cp == 1:
        return [[AttentionStep(whole, 0, 0)]], heads, []
    algorithm = get_cp_algorithm(parallel.cp_algorithm)
    # the balanced layout places each document's chunks by the documents: with one document per sample it
    # places zigzag's chunks (parallel/cp/balanced_layout.py)
    layout = "zigzag" if parallel.cp_layout == "balanced" and not documents else parallel.cp_layout

    def plans(ulysses: int) -> tuple[Sequence, int, int]:
        if documents:
            return search_rank_plans(algorithm, layout, cp, ulysses, documents, n * cp), 1, n
        small = PLAN_ROWS if n % PLAN_ROWS == 0 else n  # a static layout's plan scales with n
        return [layout_plan(algorithm, layout, cp, rank, small, ulysses) for rank in range(cp)], n // small, small

    return algorithm.attention_work(WorkInputs(heads, model.num_kv_heads // tp, model.head_dim, compute, n, cp,
                                               parallel.ulysses_size, whole, plans, documents is not None))



def _tp_collectives(model: ModelConfig, config: Config, n: int, compute: int) -> list[Collective]:
    """Per layer: the attention's and the MLP's output all-reduce (forward) and their inputs' gradient
    all-reduce (backward); with sequence parallelism a reduce-scatter and an all-gather in each place, and the
    two norms' weight gradients summed over TP (``sequence_parallel_norm``, fp32)."""
    if config.parallel.tp == 1:
        return []
    size = n * model.hidden_size * compute
    if config.parallel.sequence_parallel_on:
        return [Collective("SP all-gather of the block inputs", "all_gather", "tp", size // config.parallel.tp, 2,
                           "forward"),
                Collective("SP reduce-scatter of the outputs", "reduce_scatter", "tp", size, 2, "forward"),
                Collective("SP reduce-scatter of the input gradients", "reduce_scatter", "tp", size, 2, "backward"),
                Collective("SP all-gather of the output gradients", "all_gather", "tp", size // config.parallel.tp, 2,
                           "backward"),
                Collective("SP norm weight gradients", "all_reduce", "tp", 4 * model.hidden_size, 2, "backward")]
    return [Collective("TP all-reduce of the outputs", "all_reduce", "tp", size, 2, "forward"),
            Collective("TP all-reduce of the input gradients", "all_reduce", "tp", size, 2, "backward")]


def _tp_outside_collectives(model: ModelConfig, config: Config, rows: int, residual: int) -> list[Collective]:
    """Per micro-batch, outside the blocks (``model/gpt.py``): the vocab-parallel embedding's sum (sequence
    parallel: a reduce-scatter to the shards, an all-gather of their gradient), the head's input (sequence
    parallel: the final norm's weight gradient summed and the shards gathered, their gradient reduce-scattered;
    else its gradient all-reduced), and the vocab-parallel loss's row max and (target logit, exp-sum) all-reduces
    per chunk of ``model.loss_chunk_tokens`` rows (one chunk unfused). ``residual``: bytes of the stream."""
    tp = config.parallel.tp
    if tp == 1:
        return []
    size = rows * model.hidden_size * residual
    chunk = min(model.loss_chunk_tokens or rows, rows)
    chunks = -(-rows // chunk)
    loss = [Collective("loss row max", "all_reduce", "tp", 4 * chunk, chunks, "forward"),
            Collective("loss target logit and exp-sum", "all_reduce", "tp", 8 * chunk, chunks, "forward")]
    if not config.parallel.sequence_parallel_on:
        return [Collective("embedding sum", "all_reduce", "tp", size, 1, "forward"),
                Collective("head input gradient", "all_reduce", "tp", size, 1, "backward"), *loss]
    return [Collective("SP embedding reduce-scatter", "reduce_scatter", "tp", size, 1, "forward"),
            Collective("SP embedding gradient all-gather", "all_gather", "tp", size // tp, 1, "backward"),
            Collective("SP head input all-gather", "all_gather", "tp", size // tp, 1, "forward"),
            Collective("SP head input gradient reduce-scatter", "reduce_scatter", "tp", size, 1, "backward"),
            Collective("SP final norm weight gradient", "all_reduce", "tp", 4 * model.hidden_size, 1, "backward"),
            *loss]


# tensor passes (reads + writes) of the memory-bound ops, (compiled, eager): torch.compile fuses each into one
# read of its inputs and one write; eager runs the ops of model/*.py one kernel at a time. RMSNorm: fused
# (F.rms_norm) either way. RoPE (rope.apply_rope: x*cos + rotate_half(x)*sin): 2 fused, 9 eager (the
# half-rotation's negation and cat, two products, the sum). SwiGLU: 3 fused, 5 eager (silu, then the product).
ROPE_PASSES, SWIGLU_PASSES = {True: 2, False: 9}, {True: 3, False: 5}


def _elementwise_bytes(model: ModelConfig, config: Config, rows: int, compute: int, residual: int) -> float:
    """Forward memory traffic of one micro-batch's memory-bound work over ``rows`` tokens: per layer two
    RMSNorms (read the residual, write the compute dtype), two residual adds (read two, write one), RoPE on q and
    k, SwiGLU's silu and product (passes of ``ffn/tp`` rows), compiled or eager (``train.compile``)."""
    tp, compiled = config.parallel.tp, config.train.compile
    shard = rows // tp if config.parallel.sequence_parallel_on else rows
    hidden, d = model.hidden_size, model.head_dim
    norms = 2 * shard * hidden * (residual + compute)
    adds = 2 * 3 * shard * hidden * residual
    rope = ROPE_PASSES[compiled] * rows * (model.num_heads + model.num_kv_heads) // tp * d * compute
    swiglu = SWIGLU_PASSES[compiled] * rows * (model.ffn_hidden_size // tp) * compute
    return float(model.num_layers * (norms + adds + rope + swiglu))


def build_workload(config: Config, world: int, compute: int, documents: tuple[int, ...] | None = None) -> Workload:
    """The work list of one rank of ``config`` (validated, ``model.vocab_size`` set) on ``world`` ranks, with
    ``compute`` bytes per element of the matmul inputs (2 in bf16); ``documents``: the lengths of the
    documents packed into each sample (None: one per sample)."""
    model, parallel = config.model, config.parallel
    tp, cp = parallel.tp, parallel.cp
    dp = world // (tp * cp)
    n, batch = config.data.seq_len // cp, config.train.micro_batch_size
    rows = n * batch
    family = get_model_family(model.family)  # the block's linears as the family describes them
    gemms = [Gemm(x.name, rows, *reversed(x.shard(tp)), model.num_layers) for x in family.block_linears(model)]
    head = Gemm("lm head", rows, *reversed(family.head(model).shard(tp)), 1)
    samples = planned_samples(documents, n * cp, cp) if documents else [None]
    per_sample = {pieces: _attention_steps(model, config, n, compute, pieces) for pieces in dict.fromkeys(samples)}
    attention, heads, cp_collectives = per_sample[samples[0]]
    residual = compute if parallel.fsdp or compute == 4 else 4
    loss_passes = 4 if model.loss_chunk_tokens else 3  # fp32 logits chunk: write, max, exp-sum, target
    accumulation = config.train.global_batch_size // (batch * dp)
    return Workload(config, n, batch, compute, gemms, head, attention, heads, cp_collectives,
                    _tp_collectives(model, config, rows, compute),
                    _tp_outside_collectives(model, config, rows, residual),
                    _elementwise_bytes(model, config, rows, compute, residual),
                    float(loss_passes * rows * (model.vocab_size // tp) * 4), accumulation,
                    tuple(per_sample[pieces][0] for pieces in samples))
