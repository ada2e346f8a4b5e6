"""Seconds of one optimizer step from a rank's work list (``workload.py``) and a device's rates.

Per micro-batch: the forward and backward of every layer (matmuls at a shape-dependent efficiency, memory-
bound work at the memory bandwidth, the CP attention step by step), the recompute of activation
checkpointing, the TP collectives (not overlapped: the trainer waits for them), the CP attention's
collectives and hops (a ring hop hides behind its step's kernels, so a step costs the longer of the two; the
all-gather's chunks overlap the compute of the chunk before; Ulysses' all-to-alls are exposed), FSDP's
gathers and reduce-scatters (prefetched: exposed only where a layer's communication outlasts its compute), and
activation offload's copies over PCIe (exposed only where a block's copy outlasts a block's compute).
Per step: the micro-batches, DDP's gradient all-reduce (overlapped with the last backward but its last
bucket), the optimizer (AdamW: memory-bound, 28 bytes per local parameter) and the host's own time (``host.py``).

Which link a group uses follows Megatron's rank order (tp fastest, then cp, then dp): a group whose ranks
span more than one node runs at the network's rate, else at NVLink's (``DeviceRates.link``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.perf.rates import DeviceRates
from cp_train.perf.workload import ATTENTION_BACKWARD, AttentionStep, Collective, KernelCall, Workload

# fp8 linears (``--precision fp8``, the trainer's ``model.fp8``) cast each operand before its matmul, with current
# (dynamic) scaling as torchao's float8 training and Transformer Engine's current-scaling recipe run it. Bytes moved
# per element of an operand, by recipe (``FP8_CAST_BYTES``: forward per input or weight element, backward per input
# or weight element, backward per element of the output's gradient):
# - tensorwise (one scale per tensor): a pass for the absolute maximum (2 B), the cast reading it again (2 B) and
#   writing fp8 rows and their transpose for the other GEMM of the backward (1 + 1 B): the input and the weight in
#   the forward, the output's gradient in the backward (6, 0, 6);
# - rowwise (a scale per row along each GEMM's inner dim, torchao's ``rowwise``): no scale serves two GEMMs, so each
#   operand is cast once per GEMM it enters (amax 2 B, cast 2 B, write 1 B): the input and the weight in the
#   forward, again along their other dim for the two backward GEMMs, the output's gradient twice; and the backward
#   GEMMs (exact accumulation) run unscaled, their bf16 outputs (the input's and the weight's gradients) scaled
#   after, read and written (2 + 2 B; torchao 0.18's ``addmm_float8_unwrapped``: the rowwise kernel is slow without
#   fast accumulation) (5, 9, 10).
# The LM head stays in bf16 in both frameworks (torchao's float8 filters out the output layer; Megatron's output
# layer is not a Transformer Engine linear).
FP8_CAST_BYTES = {"tensorwise": (6, 0, 6), "rowwise": (5, 9, 10)}
ADAMW_BYTES = 28  # fused AdamW per fp32 parameter: read p, g, m, v (16), write p, m, v (12)
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Breakdown:
    """Seconds per optimizer step, by where they go (they add up to ``step``)."""

    matmuls: float
    attention: float
    elementwise: float
    recompute: float
    cp_comm: float  # exposed: what the ring's hops, the all-gather and Ulysses' all-to-alls add
    tp_comm: float
    data_comm: float  # exposed FSDP gathers and reduce-scatters, DDP's all-reduce
    optimizer: float
    host: float  # the host's dispatch and cuDNN graph builds the GPU waits for (``host.py``)
    offload: float = 0.0  # exposed activation offload: a block's copies over PCIe outlasting its compute

    @property
    def step(self) -> float:
        return sum(vars(self).values())


def collective_seconds(kind: str, size: int, ranks: int, link: tuple[float, float], base: float = 0.0) -> float:
    """Ring-algorithm time of one collective of ``size`` bytes (see ``Collective``) over ``ranks`` ranks: the
    bytes each rank moves at the link's rate, plus ``base`` and the link's latency per ring step."""
    if ranks <= 1 or size <= 0:
        return 0.0
    bandwidth, latency = link
    moved = {"all_reduce": 2 * (ranks - 1) / ranks * size, "reduce_scatter": (ranks - 1) / ranks * size,
             "all_gather": (ranks - 1) * size, "all_to_all": (ranks - 1) / ranks * size, "p2p": float(size)}[kind]
    hops = 1 if kind in ("p2p", "all_to_all") else (ranks - 1) * (2 if kind == "all_reduce" else 1)
    return moved / bandwidth + hops * latency + base


def group_spans_nodes(work: Workload, group: str, gpus_per_node: int) -> tuple[int, bool]:
    """``(ranks, spans nodes)`` of ``group`` in Megatron's order (tp, then cp, then dp): ``data`` is DP x CP,
    ``shard`` the ranks FSDP shards over (a replica's DP x CP under HSDP), ``replicate`` HSDP's replicas."""
    parallel = work.config.parallel
    tp, cp = parallel.tp, parallel.cp
    world = tp * cp * (work.config.parallel.dp or 1)
    replicas = parallel.dp_replicate if parallel.fsdp else 1
    extent = {"tp": (tp, tp), "cp": (cp, tp * cp), "ulysses": (parallel.ulysses_size, tp * parallel.ulysses_size),
              "data": (world // tp, world), "shard": (world // (tp * replicas), world // replicas),
              "replicate": (replicas, world if replicas > 1 else 1)}[group]
    return extent[0], extent[1] > gpus_per_node


def collectives_seconds(work: Workload, rates: DeviceRates, collectives: list[Collective], phase: str,
                        scale: int = 1) -> float:
    """Seconds of the ``phase`` collectives of ``collectives``, each ``scale`` times its size."""
    total = 0.0
    for c in collectives:
        if c.phase == phase:
            ranks, spans = group_spans_nodes(work, c.group, rates.gpus_per_node)
            total += c.count * collective_seconds(c.kind, c.size * scale, ranks, rates.link(spans),
                                                  rates.call_latency_s)
    return total


def _kernel_seconds(calls: tuple[KernelCall, ...], work: Workload, rates: DeviceRates) -> float:
    d = work.config.model.head_dim
    per_call = work.batch * work.attention_heads * 4.0 * d
    return sum(per_call * call.area / rates.attention(call, d) for call in calls)


def attention_seconds(work: Workload, rates: DeviceRates) -> tuple[float, float, float, float]:
    """One layer's CP attention: ``(forward kernels, backward kernels, forward exposed comm, backward exposed
    comm)`` of the slowest rank at each step (ranks wait for each other at every hop), the mean over the packed
    samples planned (``Workload.attention_samples``). A ring step costs the longer of its kernels and its hop; the
    all-gather's one transfer per direction travels in kv-head chunks behind the compute of the chunk before
    (``_overlapped``); Ulysses' all-to-alls are exposed."""
    samples = work.attention_samples or (work.attention,)
    each = [_sample_attention_seconds(work, attention, rates) for attention in samples]
    return tuple(sum(parts) / len(each) for parts in zip(*each, strict=True))  # type: ignore[return-value]


def _sample_attention_seconds(work: Workload, attention: list[list[AttentionStep]], rates: DeviceRates
                              ) -> tuple[float, float, float, float]:
    """``attention_seconds`` of one sample's steps ``attention`` ([cp rank][step])."""
    parallel = work.config.parallel
    algorithm = get_cp_algorithm(parallel.cp_algorithm)
    ranks = algorithm.ring_size(parallel.cp, parallel.ulysses_size)  # K/V travel among these; across nodes as cp
    bandwidth, latency = rates.link(group_spans_nodes(work, "cp", rates.gpus_per_node)[1])
    gathered = algorithm.gathers_kv
    kernels_f = kernels_b = exposed_f = exposed_b = 0.0
    for index in range(len(attention[0])):
        steps = [rank_steps[index] for rank_steps in attention]
        compute = max(_kernel_seconds(step.calls, work, rates) + work.batch * step.merge_forward
                      / rates.memory_bytes_per_s for step in steps)
        compute_b = max(ATTENTION_BACKWARD * _kernel_seconds(step.calls, work, rates) + work.batch
                        * step.merge_backward / rates.memory_bytes_per_s for step in steps)
        kernels_f += compute
        kernels_b += compute_b
        if not gathered and ranks > 1:
            hop_f = max(step.send_forward for step in steps) * work.batch / bandwidth + latency
            hop_b = max(step.send_backward for step in steps) * work.batch / bandwidth + latency
            exposed_f += max(0.0, hop_f - compute)
            exposed_b += max(0.0, hop_b - compute_b)
    if gathered:  # one transfer per direction, the slowest rank's bytes
        sent_f = max(sum(step.send_forward for step in steps) for steps in attention) * work.batch
        sent_b = max(sum(step.send_backward for step in steps) for steps in attention) * work.batch
        local = _kernel_seconds(attention[0][0].calls, work, rates)
        exposed_f += _overlapped(sent_f / bandwidth + rates.call_latency_s, kernels_f, local)
        exposed_b += _overlapped(sent_b / bandwidth + rates.call_latency_s, kernels_b, ATTENTION_BACKWARD * local)
    exposed_f += collectives_seconds(work, rates, work.attention_collectives, "forward", work.batch)
    exposed_b += collectives_seconds(work, rates, work.attention_collectives, "backward", work.batch)
    return kernels_f, kernels_b, exposed_f, exposed_b


def _overlapped(comm: float, compute: float, local: float, chunks: int = 2) -> float:
    """Exposed seconds of a transfer sent in ``chunks`` kv-head chunks, chunk i+1 travelling during chunk i's
    compute and chunk 0 during the rank's own block (``local``): the all-gather of ``allgather.py``."""
    if comm <= 0:
        return 0.0
    per_comm, per_compute, per_local = comm / chunks, compute / chunks, local / chunks
    exposed = max(0.0, per_comm - per_local)
    return exposed + (chunks - 1) * max(0.0, per_comm - per_compute)


def offload_seconds(moved_per_layer: int, layers: int, forward_s: float, backward_s: float, pcie_bytes_per_s: float
                    ) -> float:
    """Exposed seconds of one micro-batch's activation offload (``model.activation_offload``): each of ``layers``
    blocks copies ``moved_per_layer`` bytes to the host while the next block's forward runs (``forward_s`` per
    block) and back while the block after it runs its backward (``backward_s``, its recompute included), each
    direction on its own at ``pcie_bytes_per_s``; what a copy takes beyond its block's time is exposed."""
    if not layers or not moved_per_layer:
        return 0.0
    copy = moved_per_layer / pcie_bytes_per_s
    return layers * (max(0.0, copy - forward_s) + max(0.0, copy - backward_s))


def fp8_share(work: Workload, rates: DeviceRates) -> float:
    """The share of the blocks whose linears run in fp8: 0 unless ``rates`` plans fp8 linears, else that of
    ``ModelConfig.blocks_under_fp8`` (all but the blocks ``model.fp8_bf16_layers_at_start`` / ``_at_end`` keep)."""
    if rates.precision != "fp8":
        return 0.0
    model = work.config.model
    return len(model.blocks_under_fp8) / model.num_layers


def gemm_seconds(work: Workload, rates: DeviceRates, mlp_only: bool = False) -> float:
    """Forward seconds of one micro-batch's block GEMMs (``mlp_only``: the MLP's), the fp8 blocks' at the fp8
    rates and the others' at bf16's."""
    gemms = [g for g in work.gemms if g.name.startswith("mlp") or not mlp_only]

    def seconds(precision: str) -> float:
        return sum(g.flops / rates.matmul(g.m, g.n, g.k, precision) for g in gemms)

    share = fp8_share(work, rates)
    if share in (0.0, 1.0):
        return seconds("fp8" if share else "bf16")
    return share * seconds("fp8") + (1.0 - share) * seconds("bf16")


def matmul_seconds(work: Workload, rates: DeviceRates) -> tuple[float, float, float]:
    """``(blocks forward, head forward, blocks' elementwise forward)`` seconds of one micro-batch; the head runs
    in the compute dtype (bf16 when the linears are fp8)."""
    blocks = gemm_seconds(work, rates)
    head_gemm = work.head_gemm
    head = head_gemm.flops / rates.matmul(head_gemm.m, head_gemm.n, head_gemm.k, "bf16")
    return blocks, head, work.elementwise_bytes / rates.memory_bytes_per_s


def fp8_recipe(work: Workload) -> str:
    """The FP8 scaling recipe the run's linears use (``model.fp8``); tensorwise when the config leaves it none
    (the planner's ``--precision fp8`` turns tensorwise on)."""
    recipe = work.config.model.fp8
    return recipe if recipe in FP8_CAST_BYTES else "tensorwise"


def fp8_gathered_weights(work: Workload, rates: DeviceRates) -> float:
    """Elements of one block's linear weights (this TP rank's; the blocks' mean) FSDP all-gathers in fp8, 1 byte
    each: tensorwise under FSDP casts each weight's shard before its gather (``parallel/tp/fp8.py``); 0 for rowwise
    (gathered in the compute dtype), without FSDP or without fp8 linears."""
    if not work.config.parallel.fsdp or fp8_recipe(work) != "tensorwise":
        return 0.0
    return fp8_share(work, rates) * sum(g.k * g.n for g in work.gemms)


def fp8_cast_seconds(work: Workload, rates: DeviceRates) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch's fp8 casts (``FP8_CAST_BYTES`` of the run's recipe; 0
    unless the linears are fp8): the forward casts each block GEMM's input and weight (a weight gathered in fp8:
    this rank's shard, at each gather), the backward its output's gradient (rowwise: the input and the weight
    again, and the scaling of their gradients)."""
    share = fp8_share(work, rates)
    if not share:
        return 0.0, 0.0
    forward_bytes, again_bytes, gradient_bytes = FP8_CAST_BYTES[fp8_recipe(work)]
    inputs = sum(g.count * g.m * g.k for g in work.gemms) * share
    weights = sum(g.count * g.k * g.n for g in work.gemms) * share
    cast_weights = weights
    if fp8_gathered_weights(work, rates):
        ranks, _ = group_spans_nodes(work, "shard", rates.gpus_per_node)
        cast_weights = weights * (1 + int(work.config.parallel.fsdp_reshard_after_forward)) / ranks
    gradients = sum(g.count * g.m * g.n for g in work.gemms) * share
    return ((inputs + cast_weights) * forward_bytes / rates.memory_bytes_per_s,
            ((inputs + weights) * again_bytes + gradients * gradient_bytes) / rates.memory_bytes_per_s)
