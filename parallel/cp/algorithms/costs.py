"""What the CP algorithms report about themselves, in shapes only: the records their costs are made of.

- ``Shapes``: one rank's activation shapes, for the memory an algorithm keeps and holds (the dry run,
  ``cp_train.memory``);
- ``WorkInputs`` -> ``KernelCall``, ``AttentionStep``, ``Collective``: one layer's kernel calls, hop bytes and
  collectives per sample on every CP rank (the planner, ``cp_train.perf``), made from the very plans the trainer
  runs (``plan_steps``).

Units: bytes, rows (tokens), per rank; a plan's rows per sample unless it is packed.
"""

from __future__ import annotations

from dataclasses import dataclass

ACC = 4  # bytes of the fp32 accumulators (lse, the ring's and all-gather's dq/dk/dv)
# rows per rank a static layout is planned at when the rank has a multiple of it, then scaled: zigzag's and
# contiguous' segments are multiples of their chunks (exact); stripe's diagonal is one row off (< 0.1% of the area)
PLAN_ROWS = 2048
# passes over an fp32 [rows, heads, head_dim] tensor: the eager merge out -= sigmoid(lse_b - lse) * (out - out_b)
# reads out and out_b and writes their difference, reads and writes the product, reads both and writes out (7);
# an fp32 gradient accumulation reads both and writes one (3)
MERGE_PASSES, ACCUMULATE_PASSES = 7, 3


@dataclass(frozen=True)
class Shapes:
    """One rank's activation shapes: ``n`` tokens, per-rank heads, kv heads, ffn and vocab, dtype sizes, and
    how the rank is parallel (the CP algorithm and degrees, sequence parallelism, the kernel)."""

    n: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    compute: int  # bytes per element of the matmul inputs and outputs
    residual: int  # bytes per element of the residual stream
    cp: int = 1
    algorithm: object = None  # a CPAlgorithm (``registry.py``); None: no CP
    ulysses: int = 1  # the Ulysses degree (``CPAlgorithm.head_degree``)
    tp: int = 1
    sequence_parallel: bool = False  # the residual stream and the norms hold n / tp tokens
    cuda: bool = False  # CUDA: fused RMSNorm (input and a per-token scale kept), GQA-native kernels, 2 head chunks
    swiglu_temps: int = 1  # [n, ffn] temporaries of the SwiGLU's backward (``memory/activations.py``)
    # what an FP8 block's linears keep of their inputs (``memory/activations.py``): "kept" (the compute dtype's, as
    # bf16 linears do), "fp8" (an FP8 cast, 1 byte), "recomputed" (nothing: cast again in the backward) or "bf16"
    # (planned as bf16 linears, their weights' autocast copies too)
    fp8_inputs: str = "kept"
    # torch.compile'd blocks (Inductor's partition, ``memory/activations.py``): the stream between the attention
    # and the MLP kept as the output projection's output (compute dtype), one cast of each rope table, and under
    # selective checkpointing q, k, v recomputed with the QKV side
    compiled: bool = False

    @property
    def stream(self) -> int:
        """Tokens of the residual stream on this rank (``n / tp`` under sequence parallelism)."""
        return self.n // self.tp if self.sequence_parallel else self.n

    @property
    def ulysses_kv_heads(self) -> int:
        """kv heads Ulysses carries: each repeated until every rank of its group holds one."""
        return max(self.kv_heads, self.ulysses) if self.ulysses > 1 else self.kv_heads

    @property
    def kv_chunk(self) -> int:
        """kv heads per chunk of the ring backward and the all-gather (``parallel/cp/spec.py``: two chunks on
        GPUs; on CPU one kv head each at one thread per rank)."""
        return -(-self.kv_heads // min(2, self.kv_heads)) if self.cuda else 1


def expanded(s: Shapes, rows: int, q_heads: int, kv_heads: int, backward: bool) -> int:
    """The CPU kernel's GQA copies in one call: K and V repeated to ``q_heads`` (and their gradients)."""
    if s.cuda or q_heads == kv_heads:
        return 0
    return (4 if backward else 2) * rows * q_heads * s.head_dim * s.compute


def fp32_grads(s: Shapes, backward: bool) -> int:
    """The backward's dq, dk, dv accumulated in fp32 (and cast at the end) by the ring and the all-gather."""
    if not backward:
        return 0
    return s.n * (s.heads + 2 * s.kv_heads) * s.head_dim * (ACC + (s.compute if s.compute < ACC else 0))


@dataclass(frozen=True)
class KernelCall:
    """One attention kernel call per sample and local query head: ``rows`` queries x ``keys`` keys; ``varlen``: part
    of a step the documents shape, which the trainer runs as a varlen call (``route_by_documents``)."""

    rows: int
    keys: int
    causal: bool
    varlen: bool = False

    @property
    def area(self) -> int:
        if not self.causal:
            return self.rows * self.keys
        return self.rows * (self.keys - self.rows) + self.rows * (self.rows + 1) // 2


@dataclass(frozen=True)
class AttentionStep:
    """One step of the CP attention on one rank: its kernel calls, the bytes its hop sends meanwhile (forward,
    backward) and the memory traffic of merging its result (forward: the online-softmax update of the fp32
    output; backward: adding the step's dq into the fp32 dq and its dK/dV into the accumulator)."""

    calls: tuple[KernelCall, ...]
    send_forward: int
    send_backward: int
    merge_forward: int = 0
    merge_backward: int = 0


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``kind`` over ``group`` per micro-batch, each with ``size`` bytes of input per
    rank (the full tensor for an all-reduce or reduce-scatter, this rank's part for an all-gather), ``phase``
    forward or backward (the recompute repeats the forward's); the trainer waits for each."""

    name: str
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    group: str  # tp | cp | ulysses | data (dp x cp, FSDP and DDP)
    size: int
    count: int
    phase: str


@dataclass(frozen=True)
class WorkInputs:
    """What the planner asks an algorithm about: per TP rank ``heads``, ``kv_heads`` of ``head_dim``, ``compute``
    bytes per element, ``n`` tokens per rank and sample on ``cp`` ranks (``ulysses_size`` for hybrid) in
    ``layout``, ``whole``: the local kernel's calls over the whole sample, ``plans(ulysses) -> (every rank's
    CPPlan, rows scale)`` (one document: planned at ``PLAN_ROWS`` and scaled), ``documents``: packed or not."""

    heads: int
    kv_heads: int
    head_dim: int
    compute: int
    n: int
    cp: int
    ulysses_size: int
    whole: tuple[KernelCall, ...]
    plans: object  # Callable[[int], tuple[list[CPPlan], int, int]]: (plans, scale, planned rows per rank)
    documents: bool


def step_calls(step: object, scale: int = 1) -> tuple[KernelCall, ...]:
    """The kernel calls of one ``StepPlan``, ``scale`` times their rows (varlen where the documents shape it)."""
    return tuple(KernelCall(c.segment.rows * scale, c.segment.keys * scale, c.segment.causal, step.by_documents)
                 for c in step.calls)


def calls_of(plan: object, scale: int = 1) -> tuple[KernelCall, ...]:
    """Every kernel call of a ``RankPlan``'s steps, ``scale`` times their rows."""
    return tuple(call for step in plan.steps for call in step_calls(step, scale))


def plan_steps(plans: list, scale: int, small: int, heads: int, kv_heads: int, d: int, compute: int,
               gathered: bool) -> list[list[AttentionStep]]:
    """Every rank's ring steps of ``plans`` (``CPPlan`` with ``ring``; rows ``scale`` times the plan's, ``small``
    rows planned per rank) with ``heads`` / ``kv_heads`` per kernel call. A hop carries the K/V rows passed on
    (forward, again in the backward) and the fp32 dK/dV accumulator; ``gathered``: the all-gather's steps carry
    what its one transfer sends each destination, the rows of this rank's block that rank uses (the whole block
    when everyone uses all of it) and, in the backward, those rows again and the fp32 dK/dV of the rows received."""
    kv_row, grad_row = 2 * kv_heads * d * compute, 2 * kv_heads * d * ACC  # K and V of a token; dK, dV in fp32
    everyone = []
    for whole_plan in plans:
        plan = whole_plan.ring
        steps = []
        for index, step in enumerate(plan.steps):
            calls = step_calls(step, scale)
            if gathered:
                sent = (small if plan.whole_blocks else step.kv_rows[0]) * scale * kv_row if index else 0
                back = (small if plan.whole_blocks else step.held_rows) * scale * grad_row if index else 0
            else:
                sent, back = step.kv_rows[0] * scale * kv_row, step.grad_rows[0] * scale * grad_row
            rows, keys = sum(c.rows for c in calls), sum(c.keys for c in calls)
            merge = MERGE_PASSES * rows * heads * d * ACC if index else 0
            accumulate = ACCUMULATE_PASSES * ACC * d * (rows * heads + 2 * keys * kv_heads) if index else 0
            steps.append(AttentionStep(calls, sent, sent + back, merge, accumulate))
        everyone.append(steps)
    return everyone
