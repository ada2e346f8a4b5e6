"""Communication on CPU ranks (gloo): nothing hides behind compute.

On a GPU the ring's hop travels while the kernels run (``time_model.attention_seconds``). On CPU the cores that
compute also move the bytes (gloo copies through loopback sockets on the ranks' own threads, and with ranks >=
cores nothing is idle to do it), so the time model charges a CPU profile's communication in full:

- the CP attention op: its measured cost per call at a negligible size (``CpuConstants.attention_call_us``: the
  Python, dispatch, message posting and waiting of the ring, the all-gather or Ulysses at the world size, by
  kv-head chunks) per layer and micro-batch, a third in the forward, plus its bytes at gloo's bandwidth: the
  ring's K/V hops and fp32 dK/dV accumulators, the all-gather's K/V (twice) and fp32 dK/dV reduce-scatter, the
  Ulysses all-to-alls (``Workload.attention_collectives``);
- FSDP: each layer's all-gather (again in the backward when resharding after forward) and reduce-scatter; DDP:
  its gradient all-reduce in 25 MiB buckets; all at gloo's bandwidth and latencies (``Rates.link``).

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


class CpuRates(Rates, Protocol):
    def cp_call_seconds(self, algorithm: str, group: int, chunks: int) -> float:
        """Seconds of one CP attention op call's own cost (``CpuConstants.attention_call_us``)."""


def head_chunks(work: Workload, threads: int) -> int:
    """The kv-head chunks of the CP attention's backward (and the all-gather) on a CPU rank with ``threads``."""
    model, parallel = work.config.model, work.config.parallel
    algorithm = canonical_algorithm(parallel.cp_algorithm)
    ulysses = parallel.ulysses_size if algorithm == "hybrid" else (parallel.cp if algorithm == "ulysses" else 1)
    kv = max(1, model.num_kv_heads // parallel.tp // ulysses)
    rows_per_kv = work.batch * work.attention_heads // kv
    return max(1, kv // -(-threads // max(1, rows_per_kv)))


def _moved(kind: str, size: float, ranks: int, bandwidth: float) -> float:
    """Seconds of the bytes one collective of ``size`` moves per rank, latencies left out."""
    return collective_seconds(kind, int(size), ranks, (bandwidth, 0.0))


def cp_comm_seconds(work: Workload, rates: CpuRates, threads: int) -> tuple[float, float]:
    """One layer's CP communication on CPU ranks, ``(forward, backward)`` seconds of the slowest rank."""
    parallel = work.config.parallel
    if parallel.cp == 1:
        return 0.0, 0.0
    algorithm = canonical_algorithm(parallel.cp_algorithm)
    ulysses = parallel.ulysses_size if algorithm == "hybrid" else (parallel.cp if algorithm == "ulysses" else 1)
    ring = parallel.cp // ulysses
    bandwidth = rates.link(False)[0]
    chunks, batch = head_chunks(work, threads), work.batch
    calls = rates.cp_call_seconds("ulysses", ulysses, 1) if ulysses > 1 else 0.0
    if ring > 1:
        calls += rates.cp_call_seconds("allgather" if algorithm == "allgather" else "ring", ring, chunks)
    forward, backward = FORWARD_SHARE * calls, (1 - FORWARD_SHARE) * calls
    if algorithm == "allgather":
        model = work.config.model
        mine = work.n * 2 * max(1, model.num_kv_heads // parallel.tp) * model.head_dim * batch  # K, V elements
        gather = _moved("all_gather", mine * work.compute_bytes, ring, bandwidth)
        forward += gather
        backward += gather + _moved("reduce_scatter", ring * mine * 4, ring, bandwidth)
    elif ring > 1:
        forward += max(sum(step.send_forward for step in steps) for steps in work.attention) * batch / bandwidth
        backward += max(sum(step.send_backward for step in steps) for steps in work.attention) * batch / bandwidth
    for c in work.attention_collectives:  # Ulysses' all-to-alls
        seconds = c.count * _moved(c.kind, c.size * batch, ulysses, bandwidth)
        forward, backward = (forward + seconds, backward) if c.phase == "forward" else (forward, backward + seconds)
    return forward, backward


def data_seconds(work: Workload, rates: Rates, layer_parameters: int, root_parameters: int) -> float:
    """FSDP's gathers and reduce-scatters, or DDP's bucketed all-reduce, of one step on CPU ranks (none hidden)."""
    parallel, model = work.config.parallel, work.config.model
    ranks, spans = group_spans_nodes(work, "data", rates.gpus_per_node)
    link, call = rates.link(spans), rates.call_latency_s
    if not parallel.fsdp:
        total = 4 * (model.num_layers * layer_parameters + root_parameters) // parallel.tp
        buckets = -(-total // DDP_BUCKET_BYTES)
        return buckets * collective_seconds("all_reduce", total // buckets, ranks, link, call)
    layer = layer_parameters // parallel.tp
    gather = collective_seconds("all_gather", work.compute_bytes * layer // ranks, ranks, link, call)
    scatter = collective_seconds("reduce_scatter", 4 * layer, ranks, link, call)
    gathers = 2 if parallel.fsdp_reshard_after_forward else 1
    reduces = work.accumulation if parallel.fsdp_reduce == "per_microbatch" else 1
    return model.num_layers * (work.accumulation * gathers * gather + reduces * scatter)
