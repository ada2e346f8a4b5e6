"""Communication on CPU ranks (gloo): nothing hides behind compute.

On a GPU the ring's hop travels while the kernels run (``time_model.attention_seconds``). On CPU the cores that
compute also move the bytes (gloo copies through loopback sockets on the ranks' own threads, and with ranks >=
cores nothing is idle to do it), so the time model charges a CPU profile's communication in full:

- the CP attention op: its measured cost per call at a negligible size (``CpuConstants.attention_call_us``: the
  Python, dispatch, message posting and waiting of the ring, the all-gather or Ulysses at the world size, by
  kv-head chunks) per layer and micro-batch, a third in the forward, plus its measured cost per byte of the
  call's tensors beyond that (``attention_byte_us``), plus its bytes at gloo's bandwidth for the collective the
  op calls (``Rates.kind_link``): the ring's K/V hops and fp32 dK/dV accumulators, the all-gather's K/V (twice)
  and fp32 dK/dV reduce-scatter (both all-to-alls), the Ulysses all-to-alls (``Workload.attention_collectives``);
- FSDP: every unit's all-gather (again in the backward when resharding after forward) and reduce-scatter with
  their copies, and its measured cost per unit (``fsdp_unit_us``); DDP: its gradient all-reduce in 25 MiB
  buckets; each at its kind's bandwidth and latencies.

Head chunks as ``parallel/cp/spec.default_head_chunks`` picks them on CPU: as many as leave each of the rank's
threads ``batch x query heads`` rows to work on (one kv head per chunk at one thread per rank).
"""

from __future__ import annotations

from typing import Protocol

from cp_train.parallel.cp.algorithms import canonical_algorithm
from cp_train.plan.time_model import (
    DDP_BUCKET_BYTES,
    Rates,
    collective_seconds,
    group_spans_nodes,
)
from cp_train.plan.workload import Workload

FORWARD_SHARE = 1 / 3  # of the attention op's cost per call: the backward posts twice the forward's messages
# memory passes of one FSDP2 collective, over the full and the shard bytes: a gather reads and writes the shard
# into its input and the gathered buffer out to the parameters; a reduce-scatter reads and writes the gradients
# into its input and reads and writes the shard it adds
FSDP_GATHER_PASSES = FSDP_SCATTER_PASSES = 2


class CpuRates(Rates, Protocol):
    def cp_call_seconds(self, algorithm: str, group: int, chunks: int) -> float:
        """Seconds of one CP attention op call's own cost (``CpuConstants.attention_call_us``)."""

    def cp_byte_seconds(self, algorithm: str, group: int, size: float) -> float:
        """Seconds of a CP attention op call's cost beyond its negligible size (``CpuConstants.attention_byte_us``)."""

    def fsdp_unit_seconds(self) -> float | None:
        """Seconds of FSDP's own cost per unit and micro-batch (``CpuConstants.fsdp_unit_us``; None: unknown)."""


def head_chunks(work: Workload, threads: int) -> int:
    """The kv-head chunks of the CP attention's backward (and the all-gather) on a CPU rank with ``threads``."""
    model, parallel = work.config.model, work.config.parallel
    algorithm = canonical_algorithm(parallel.cp_algorithm)
    ulysses = parallel.ulysses_size if algorithm == "hybrid" else (parallel.cp if algorithm == "ulysses" else 1)
    kv = max(1, model.num_kv_heads // parallel.tp // ulysses)
    rows_per_kv = work.batch * work.attention_heads // kv
    return max(1, kv // -(-threads // max(1, rows_per_kv)))


def _moved(kind: str, size: float, ranks: int, rates: Rates, as_kind: str | None = None) -> float:
    """Seconds of the bytes one collective of ``size`` moves per rank, latencies left out, at the rate of the
    collective the trainer calls for it (``as_kind``: e.g. the all-gather algorithm's all-to-alls)."""
    bandwidth = rates.kind_link(as_kind or kind, False)[0][0]
    return collective_seconds(kind, int(size), ranks, (bandwidth, 0.0))


def cp_comm_seconds(work: Workload, rates: CpuRates, threads: int) -> tuple[float, float]:
    """One layer's CP communication on CPU ranks, ``(forward, backward)`` seconds of the slowest rank."""
    parallel = work.config.parallel
    if parallel.cp == 1:
        return 0.0, 0.0
    algorithm = canonical_algorithm(parallel.cp_algorithm)
    ulysses = parallel.ulysses_size if algorithm == "hybrid" else (parallel.cp if algorithm == "ulysses" else 1)
    ring = parallel.cp // ulysses
    chunks, batch = head_chunks(work, threads), work.batch
    model = work.config.model
    heads, kv = model.num_heads // parallel.tp, max(1, model.num_kv_heads // parallel.tp)
    size = batch * work.n * (2 * heads + 2 * kv) * model.head_dim * work.compute_bytes  # q, k, v, out per call
    calls = 0.0
    if ulysses > 1:
        calls += rates.cp_call_seconds("ulysses", ulysses, 1) + rates.cp_byte_seconds("ulysses", ulysses, size)
    if ring > 1:
        kind = "allgather" if algorithm == "allgather" else "ring"
        calls += rates.cp_call_seconds(kind, ring, chunks) + rates.cp_byte_seconds(kind, ring, size / ulysses)
    forward, backward = FORWARD_SHARE * calls, (1 - FORWARD_SHARE) * calls
    if algorithm == "allgather":
        mine = work.n * 2 * max(1, model.num_kv_heads // parallel.tp) * model.head_dim * batch  # K, V elements
        gather = _moved("all_gather", mine * work.compute_bytes, ring, rates, "all_to_all")
        forward += gather
        backward += gather + _moved("reduce_scatter", ring * mine * 4, ring, rates, "all_to_all")
    elif ring > 1:
        bandwidth = rates.kind_link("p2p", False)[0][0]
        forward += max(sum(step.send_forward for step in steps) for steps in work.attention) * batch / bandwidth
        backward += max(sum(step.send_backward for step in steps) for steps in work.attention) * batch / bandwidth
    for c in work.attention_collectives:  # Ulysses' all-to-alls
        seconds = c.count * _moved(c.kind, c.size * batch, ulysses, rates)
        forward, backward = (forward + seconds, backward) if c.phase == "forward" else (forward, backward + seconds)
    return forward, backward


def data_seconds(work: Workload, rates: CpuRates, layer_parameters: int, root_parameters: int) -> float:
    """FSDP's gathers and reduce-scatters, or DDP's bucketed all-reduce, of one step on CPU ranks (none hidden).

    FSDP (``model/parallelize.py``): every block and the root (embedding, final norm, head) is a unit; per
    micro-batch each unit is gathered for the forward and, resharded after it, again for the backward (not the
    last block, nor the root, which keep theirs), and reduce-scattered once per reduction. Each gather copies the
    local shard in and the gathered parameters out (``FSDP_GATHER_PASSES``), each reduce-scatter copies the fp32
    gradients in and adds the reduced shard (``FSDP_SCATTER_PASSES``): memory traffic at the copy bandwidth. With
    a measured cost per unit (``fsdp_unit_seconds``: hooks, copies and calls at a negligible size) each unit and
    micro-batch costs that plus its bytes, in place of the collectives' latencies."""
    parallel, model = work.config.parallel, work.config.model
    ranks, spans = group_spans_nodes(work, "data", rates.gpus_per_node)
    if not parallel.fsdp:
        total = 4 * (model.num_layers * layer_parameters + root_parameters) // parallel.tp
        buckets = -(-total // DDP_BUCKET_BYTES)
        reduce = rates.kind_link("all_reduce", spans)
        return buckets * collective_seconds("all_reduce", total // buckets, ranks, *reduce)
    memory = rates.memory_bytes_per_s
    unit = rates.fsdp_unit_seconds()

    def link(kind: str) -> tuple[tuple[float, float], float]:  # the unit's measured cost holds the latencies
        (bandwidth, step), call = rates.kind_link(kind, spans)
        return ((bandwidth, 0.0), 0.0) if unit is not None else ((bandwidth, step), call)

    def gather(parameters: int) -> float:
        full = work.compute_bytes * parameters
        return (collective_seconds("all_gather", full // ranks, ranks, *link("all_gather"))
                + FSDP_GATHER_PASSES * (full + full // ranks) / memory)

    def scatter(parameters: int) -> float:
        full = 4 * parameters
        return (collective_seconds("reduce_scatter", full, ranks, *link("reduce_scatter"))
                + FSDP_SCATTER_PASSES * (full + full // ranks) / memory)

    layer, root = layer_parameters // parallel.tp, root_parameters // parallel.tp
    resharded = model.num_layers - 1 if parallel.fsdp_reshard_after_forward else 0
    gathers = (model.num_layers + resharded) * gather(layer) + gather(root)
    reduces = work.accumulation if parallel.fsdp_reduce == "per_microbatch" else 1
    measured = work.accumulation * (model.num_layers + 1) * (unit or 0.0)
    return measured + work.accumulation * gathers + reduces * (model.num_layers * scatter(layer) + scatter(root))
