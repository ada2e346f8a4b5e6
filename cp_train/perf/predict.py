"""One layout's prediction: step time by part, tokens/s, TFLOP/s and MFU under both FLOP conventions, and the
dry run's memory per rank (``cp_train.memory.dry_run``, the same plan ``train.py --dry-run`` prints)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cp_train.config.schema import Config
from cp_train.memory.dry_run import GIB, memory_plan, with_vocab
from cp_train.memory.offload import HOST_USABLE_FRACTION, checkpoint_copy_bytes, ranks_per_node
from cp_train.model.family import attention_flops, matmul_params, model_flops_per_token
from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.perf.host import host_seconds
from cp_train.perf.inputs.documents import document_pieces
from cp_train.perf.inputs.presets import layer_parameters, parameter_count, root_parameters
from cp_train.perf.ranges import ErrorBand, Regime, band, regime_of
from cp_train.perf.rates import DeviceRates
from cp_train.perf.time_model import (
    ADAMW_BYTES,
    DDP_BUCKET_BYTES,
    Breakdown,
    attention_seconds,
    collective_seconds,
    collectives_seconds,
    fp8_cast_seconds,
    fp8_gathered_weights,
    gemm_seconds,
    group_spans_nodes,
    matmul_seconds,
    offload_seconds,
)
from cp_train.perf.workload import Workload, build_workload


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step (``breakdown``), throughput and memory (GiB per component, the largest rank)."""

    config: Config
    world: int
    breakdown: Breakdown
    tokens_per_step: int
    flops_per_token: dict[str, float]  # "causal_half" (Megatron-Bridge) and "causal_full" (torchtitan)
    peak_tflops: float
    memory_gib: dict[str, float]
    usable_gib: float
    regime: Regime  # its class for the error range (``ranges.py``)
    kernel: str  # the attention kernel planned
    precision: str  # the linears' precision planned
    host_usable_gib: float = float("inf")  # a node's host memory activation offload may fill (``memory_gib``'s host)

    @property
    def band(self) -> ErrorBand:
        """The errors of the measured runs like it (``ranges.band``)."""
        return band(self.regime)

    @property
    def step_time_s(self) -> float:
        return self.breakdown.step

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.world

    @property
    def fits(self) -> bool:
        """The largest rank within the device and, with activation offload, a node's ranks within its host."""
        return (self.memory_gib["total"] <= self.usable_gib
                and self.memory_gib.get("host_per_node", 0.0) <= self.host_usable_gib)

    def tflops_per_gpu(self, convention: str) -> float:
        return self.flops_per_token[convention] * self.tokens_per_s_per_gpu / 1e12

    def record(self) -> dict[str, Any]:
        """The JSON line of this layout (``cp-train-plan --json``)."""
        p, m, t = self.config.parallel, self.config.model, self.config.train
        conventions = tuple(self.flops_per_token)
        subgroups = get_cp_algorithm(p.cp_algorithm).subgroups
        return {"tp": p.tp, "cp": p.cp, "dp": self.world // (p.tp * p.cp), "cp_algorithm": p.cp_algorithm,
                "ulysses_size": p.ulysses_size if subgroups else None, "cp_layout": p.cp_layout,
                "fsdp": p.fsdp, "sequence_parallel": p.sequence_parallel_on,
                "activation_checkpointing": m.activation_checkpointing, "mlp_chunks": m.mlp_chunks,
                "activation_offload": m.activation_offload,
                "micro_batch": t.micro_batch_size, "seq_len": self.config.data.seq_len, "gpus": self.world,
                "attention_kernel": self.kernel, "precision": self.precision,
                "step_time_s": self.step_time_s, "step_time_s_range": list(self.band.seconds(self.step_time_s)),
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tokens_per_s_per_gpu_range": list(self.band.throughput(self.tokens_per_s_per_gpu)),
                "tflops_per_gpu": {c: self.tflops_per_gpu(c) for c in conventions},
                "tflops_per_gpu_range": {c: list(self.band.throughput(self.tflops_per_gpu(c))) for c in conventions},
                "mfu": {c: self.tflops_per_gpu(c) / self.peak_tflops for c in conventions},
                "regime": "/".join(self.band.regime), "range_runs": len(self.band.runs),
                "memory_gib": self.memory_gib, "usable_gib": self.usable_gib, "fits": self.fits,
                "breakdown_s": vars(self.breakdown)}


FSDP_COPY_OUT_PASSES = 2  # bytes of the unsharded parameters an FSDP2 copy-out reads and writes


def _data_parallel_seconds(work: Workload, rates: DeviceRates, forward: float, backward: float) -> float:
    """Exposed FSDP or DDP seconds per step: FSDP prefetches a layer's gather during the layer before and
    reduce-scatters while the next layer's backward runs, but copies each gathered unit out on the compute stream;
    DDP all-reduces in buckets during the backward."""
    config, model = work.config, work.config.model
    parallel = config.parallel
    ranks, spans = group_spans_nodes(work, "data", rates.gpus_per_node)
    link = rates.link(spans)
    layer = layer_parameters(model) // parallel.tp
    per_layer_f, per_layer_b = forward / model.num_layers, backward / model.num_layers
    if not parallel.fsdp:
        total = (model.num_layers * layer_parameters(model) + root_parameters(model)) // parallel.tp
        reduce = collective_seconds("all_reduce", 4 * total, ranks, link)
        bucket = collective_seconds("all_reduce", min(DDP_BUCKET_BYTES, 4 * total), ranks, link)
        return max(bucket, reduce - backward)
    ranks, spans = group_spans_nodes(work, "shard", rates.gpus_per_node)  # HSDP: a replica's ranks
    link = rates.link(spans)
    replicas, across = group_spans_nodes(work, "replicate", rates.gpus_per_node)
    # a block's gathered bytes: tensorwise FP8 gathers its linear weights in fp8 (1 B), the rest in the compute dtype
    gathered = work.compute_bytes * layer - (work.compute_bytes - 1) * fp8_gathered_weights(work, rates)
    gather = collective_seconds("all_gather", gathered / ranks, ranks, link)
    scatter = collective_seconds("reduce_scatter", 4 * layer, ranks, link)
    # HSDP all-reduces each layer's gradient shard across the replicas after its reduce-scatter, during the backward
    scatter += collective_seconds("all_reduce", 4 * layer // ranks, replicas, rates.link(across))
    gathers_backward = 1 if parallel.fsdp_reshard_after_forward else 0
    per_micro = model.num_layers * (max(0.0, gather - per_layer_f) + gathers_backward * max(0.0, gather - per_layer_b))
    reduces = work.accumulation if parallel.fsdp_reduce == "per_microbatch" else 1
    # the root unit (embedding, final norm, head) is gathered before the first layer and keeps its parameters until
    # the backward, and reduce-scattered after the last: nothing to hide behind (``model/parallelize.py``)
    root = root_parameters(model) // parallel.tp
    root_gather = collective_seconds("all_gather", work.compute_bytes * root // ranks, ranks, link)
    root_scatter = collective_seconds("reduce_scatter", 4 * root, ranks, link) + collective_seconds(
        "all_reduce", 4 * root // ranks, replicas, rates.link(across))
    # each gathered unit is copied out into its parameters on the compute stream (FSDP2's ``wait_for_unshard``:
    # ``foreach_all_gather_copy_out``), nothing to hide behind: the gathered buffer read and the parameters written
    per_micro += FSDP_COPY_OUT_PASSES * (model.num_layers * (1 + gathers_backward) * gathered
                                         + work.compute_bytes * root) / rates.memory_bytes_per_s
    return (work.accumulation * (per_micro + root_gather)
            + reduces * (model.num_layers * max(0.0, scatter - per_layer_b) + root_scatter))


def breakdown(work: Workload, rates: DeviceRates, documents: tuple[int, ...] | None = None,
              offload: tuple[int, int] = (0, 0)) -> Breakdown:
    """The step's seconds by part (see ``time_model.py``); ``documents``: the packed documents' lengths (the host's
    cuDNN graphs, ``host.py``); ``offload``: activation offload's ``(bytes each block moves, blocks that move)``
    (the dry run's ``moved_per_layer`` and ``offloaded_layers``)."""
    config, model = work.config, work.config.model
    blocks, head, elementwise = matmul_seconds(work, rates)
    cast_f, cast_b = fp8_cast_seconds(work, rates)
    loss = work.loss_bytes / rates.memory_bytes_per_s
    attn_f, attn_b, cp_f, cp_b = (model.num_layers * x for x in attention_seconds(work, rates))
    tp_f = model.num_layers * collectives_seconds(work, rates, work.tp_collectives, "forward")
    tp_b = model.num_layers * collectives_seconds(work, rates, work.tp_collectives, "backward")
    tp_outside = sum(collectives_seconds(work, rates, work.tp_outside_collectives, phase)
                     for phase in ("forward", "backward"))
    mode = model.activation_checkpointing
    recompute = head if model.loss_chunk_tokens else 0.0  # the fused loss recomputes its logits
    recompute_tp = 0.0
    if mode in ("full", "selective"):
        recompute += blocks + elementwise + cast_f
        recompute_tp = tp_f
        if mode == "full":
            recompute += attn_f + cp_f
    elif model.mlp_chunks > 1:  # each MLP slice is checkpointed on its own
        recompute += gemm_seconds(work, rates, mlp_only=True)
    forward = blocks + head + elementwise + loss + attn_f
    backward = 2 * (blocks + head + elementwise + loss) + attn_b
    local_params = (model.num_layers * layer_parameters(model) + root_parameters(model)) / config.parallel.tp
    if config.parallel.fsdp:
        local_params /= work.config.parallel.cp * (config.parallel.dp or 1)
    a, hardware = work.accumulation, rates.hardware
    # one block's forward and backward (its recompute included), what its offload copies travel behind
    block_f = (blocks + elementwise + attn_f + cp_f) / model.num_layers
    block_b = (2 * (blocks + elementwise) + attn_b + cp_b + recompute
               - (head if model.loss_chunk_tokens else 0.0)) / model.num_layers
    return Breakdown(matmuls=a * 3 * (blocks + head), attention=a * (attn_f + attn_b),
                     elementwise=a * (3 * (elementwise + loss) + cast_f + cast_b), recompute=a * recompute,
                     cp_comm=a * (cp_f + cp_b), tp_comm=a * (tp_f + tp_b + recompute_tp + tp_outside),
                     data_comm=_data_parallel_seconds(work, rates, forward, backward),
                     optimizer=ADAMW_BYTES * local_params / rates.memory_bytes_per_s,
                     host=host_seconds(work, hardware.host_op_us, hardware.graph_build_ms, rates.kernel, documents),
                     offload=a * offload_seconds(*offload, block_f, block_b, rates.pcie_bytes_per_s))


def predict(config: Config, world: int, rates: DeviceRates, peak_tflops: float, device_gib: float,
            reserve_gib: float, documents: tuple[int, ...] | None = None, fp8_keeps: str | None = None
            ) -> Prediction:
    """``config`` (validated by the dry run's ``memory_plan``) on ``world`` ranks of a device with ``rates``;
    ``documents``: the lengths of the documents packed into each sample (``documents.py``; None: one document
    per sample, or ``data.document_mask`` off); ``fp8_keeps``: ``memory_plan``'s, for another framework's run."""
    # rank 0 holds FSDP's largest shards
    dims, ranks, activations, assumed = memory_plan(config, world, only=[0], fp8_keeps=fp8_keeps)
    config = replace(with_vocab(config), parallel=replace(config.parallel, dp=dims.dp))  # ``config`` is not changed
    compute = 2 if assumed["compute"] == "bf16" else 4
    work = build_workload(config, world, compute, documents if config.data.document_mask else None)
    worst = max(ranks, key=lambda r: r.total_bytes)
    memory = {"parameters": worst.parameter_bytes / GIB, "gradients": worst.gradients_at_peak / GIB,
              "optimizer": worst.optimizer_bytes / GIB, "gathered": worst.gathered_bytes / GIB,
              "activations": worst.activation_bytes / GIB, "total": worst.total_bytes / GIB}
    hardware = rates.hardware
    node = ranks_per_node(world, hardware.gpus_per_node)
    offloaded = assumed["offload"].host_bytes if assumed["offload"] is not None else 0
    copy = checkpoint_copy_bytes(config, worst.parameter_bytes, worst.optimizer_bytes)  # checkpoint.async_save
    host = (offloaded + copy) / GIB
    if host:
        memory.update(host=host, host_per_node=node * host)
    seq = config.data.seq_len
    flops = {"causal_half": model_flops_per_token(config.model, seq, causal=True),
             "causal_full": model_flops_per_token(config.model, seq, causal=False)}
    if documents and config.data.document_mask:  # attention counts the pairs inside each document, as the trainer
        pieces = document_pieces(documents, seq)
        dense = 6.0 * matmul_params(config.model)
        flops = {"causal_half": dense + attention_flops(config.model, sum(c * (c + 1) // 2 for c in pieces)) / seq,
                 "causal_full": dense + attention_flops(config.model, sum(c * c for c in pieces)) / seq}
    tokens = config.train.global_batch_size * seq
    regime = regime_of(parameter_count(config.model), seq, rates.precision, world, hardware.gpus_per_node)
    moved = (activations["moved_per_layer"], activations["offloaded_layers"])
    return Prediction(config, world, breakdown(work, rates, documents if config.data.document_mask else None, moved),
                      tokens, flops, peak_tflops, memory, device_gib - reserve_gib, regime, rates.kernel,
                      rates.precision, HOST_USABLE_FRACTION * hardware.host_memory_gib)


def cp_check_seconds(config: Config, rates: DeviceRates) -> float:
    """One in-run CP check (``train.check_cp_every``, ``runtime/cp_check.py``): the forward of one micro-batch's
    whole sample on one rank, TP kept, no CP (the planner's forward of ``config`` at cp 1, one document per
    sample: the dense upper bound)."""
    whole = replace(with_vocab(config), parallel=replace(config.parallel, cp=1, dp=1, fsdp=False, cp_algorithm="ring"),
                    train=replace(config.train, global_batch_size=config.train.micro_batch_size,
                                  gradient_accumulation_steps=None))
    work = build_workload(whole, whole.parallel.tp, 2)
    blocks, head, elementwise = matmul_seconds(work, rates)
    attention = attention_seconds(work, rates)[0]
    tp = collectives_seconds(work, rates, work.tp_collectives, "forward")
    return blocks + head + elementwise + work.loss_bytes / rates.memory_bytes_per_s + whole.model.num_layers * (
        attention + tp)
