"""The dry run's text (``train.py --dry-run``): the plan of ``dry_run.py`` per rank, the reserve, the verdict, and
what to change when the largest rank does not fit (``shrink_hint``)."""

from __future__ import annotations

from typing import NamedTuple

from cp_train.config.schema import Config
from cp_train.memory.communicators import communicator_lines, communicators
from cp_train.memory.dry_run import GIB, RankMemory, memory_plan, sig3, with_vocab
from cp_train.memory.fsdp_reduce import resolve_fsdp_reduce, with_reduce
from cp_train.memory.offload import (
    HOST_USABLE_FRACTION,
    PREFETCH_LAYERS,
    HostMemory,
    OffloadPlan,
    checkpoint_copy_bytes,
    host_hint,
    ranks_per_node,
)
from cp_train.memory.phases import PHASES


class DryRunReport(NamedTuple):
    text: str
    fits: bool  # the largest rank's total within the device memory (and offloaded activations within the host's)
    largest_gib: float = 0.0  # the largest rank's planned total
    usable_gib: float = 0.0  # the device's memory less the reserve
    hint: str = ""  # what to change to need less device memory (``shrink_hint``), said whether or not it fits


def report(config: Config, world: int, device_gib: float, source: str = "the config",
           reserve_gib: float = 0.0, host: HostMemory | None = None) -> DryRunReport:
    """The dry run's text (the layout and assumptions, ``fsdp_reduce`` with FSDP, the activation terms, with
    ``model.activation_offload`` what moves to host memory and the host per rank and per node, one line per rank,
    the reserve, the verdict and, when the largest rank does not fit, what to change) and whether it fits: the
    largest rank within ``device_gib`` less ``reserve_gib`` (CUDA context, NCCL, fragmentation) and, with offload
    and ``host`` (a node's host memory), the offloaded activations of a node's ranks within its usable part."""
    config = with_vocab(config)
    reduce, why = resolve_fsdp_reduce(config, world, device_gib, reserve_gib)
    auto = config.parallel.fsdp_reduce == "auto"
    config = with_reduce(config, reduce)
    dims, ranks, activations, assumed = memory_plan(config, world)
    parallel, model = config.parallel, config.model
    worst = max(ranks, key=lambda r: r.total_bytes)
    zero = "ZeRO-3" if parallel.fsdp_reshard_after_forward else "ZeRO-2"
    mode = (f"FSDP over dp x cp ({zero})" if parallel.fsdp and parallel.dp_replicate == 1 else
            f"HSDP: FSDP over dp/{parallel.dp_replicate} x cp ({zero}), {parallel.dp_replicate} replicas"
            if parallel.fsdp else "DDP (replicated parameters)")
    sp = ", sequence parallel" if assumed["sequence_parallel"] else ""
    lines = [f"dry run of {source}: {assumed['parameters']:,} parameters, world {dims.world} = tp {dims.tp} x cp "
             f"{dims.cp} x dp {dims.dp}, {mode}, {assumed['compute']} compute on {assumed['device']}"
             f"{' (--set parallel.backend=gloo: CPU)' if assumed['device'] == 'cuda' else ''}, "
             f"{assumed['tokens_per_rank']:,} tokens per rank per micro-batch, "
             f"{assumed['accumulation']} micro-batch(es) per step, cp_algorithm {assumed['algorithm']}{sp}"]
    if parallel.fsdp:
        lines.append(f"parallel.fsdp_reduce {'auto: ' if auto else ''}{reduce} ({why})")
    gib = lambda key: sig3(activations[key] / GIB)  # noqa: E731
    head = worst.phase != "block"  # the working set of the head's backward, else of a block's
    lines.append(f"activations per rank (estimate): blocks {gib('blocks')} GiB ({model.num_layers} blocks, block input "
                 f"{gib('block_input')} GiB, activation checkpointing {model.activation_checkpointing}, mlp_chunks "
                 f"{model.mlp_chunks}), head and loss {gib('head')} GiB, backward working set "
                 f"{gib('head_backward' if head else 'block_backward')} GiB in {'the head' if head else 'a block'}'s "
                 f"({gib('block_backward' if head else 'head_backward')} in {'a block' if head else 'the head'}'s): "
                 f"peak {sig3(worst.activation_bytes / GIB)} GiB at {PHASES[worst.phase]}")
    plan, host_fits, host_need = assumed["offload"], True, 0
    staging = checkpoint_copy_bytes(config, worst.parameter_bytes, worst.optimizer_bytes)
    if plan is not None or staging:
        held, host_fits, host_need = host_lines(plan, staging, assumed["device"] == "cuda", host,
                                                host.ranks_per_node if host else ranks_per_node(world))
        lines += held
    header = ("rank", "parameters", "gradients", "optimizer", "state", "gathered", "activations", "total")
    rows = [header] + [(str(r.rank), *(sig3(b / GIB) for b in (
        r.parameter_bytes, r.gradients_at_peak, r.optimizer_bytes, r.state_at_peak,
        r.gathered_bytes, r.activation_bytes, r.total_bytes))) for r in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    if worst.unmade_gradient_bytes:
        lines.append(f"gradients: {sig3(worst.gradients_at_peak / GIB)} of {sig3(worst.gradient_bytes / GIB)} GiB "
                     f"exist at {PHASES[worst.phase]} (freed at each step's start, made by the backward: one "
                     f"micro-batch a step{'' if parallel.fsdp else ' and no DDP buckets'})")
    lines.append("GiB per rank at the peak:")
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    usable = device_gib - reserve_gib
    fits = worst.total_bytes <= usable * GIB
    if assumed["device"] == "cuda":
        lines += communicator_lines(communicators(config, dims.dp, ranks_per_node(world)))
    lines.append(f"reserve: {sig3(reserve_gib)} GiB per device for the runtime (CUDA context, NCCL) and fragmentation "
                 f"(--reserve-gib, --reserve-fraction): {sig3(usable)} of {device_gib:g} GiB usable")
    lines.append(f"{'fits' if fits else 'does NOT fit'}: the largest rank ({worst.rank}) needs "
                 f"{sig3(worst.total_bytes / GIB)} GiB of {sig3(usable)} GiB usable per device "
                 f"({100 * worst.total_bytes / (usable * GIB):.0f}%)")
    if not fits:
        lines.append(f"to fit: {shrink_hint(config, worst, assumed['accumulation'])}")
    elif not host_fits:
        held = [("the offloaded activations", host_hint(model))] if plan else []  # what the host holds, the fix
        held += [("the checkpoint copy", "checkpoint.async_save=false")] if staging else []
        lines.append(f"does NOT fit the host: {' and '.join(name for name, _ in held)} need "
                     f"{sig3(host_need / GIB)} GiB per node of {sig3(host.usable_gib)} GiB usable ({host.source})")
        lines.append(f"to fit: {'; '.join(hint for _, hint in held)}")
    return DryRunReport("\n".join(lines), fits and host_fits, worst.total_bytes / GIB, usable,
                        shrink_hint(config, worst, assumed["accumulation"]))


def host_lines(plan: OffloadPlan | None, staging: int, cuda: bool, host: HostMemory | None,
               ranks_per_node: int) -> tuple[list[str], bool, int]:
    """The report's lines about what a rank keeps in host memory (``plan``'s offloaded activations, ``staging``
    bytes of checkpoint copy), whether a node's host memory holds it (True without ``host``) and a node's bytes."""
    g = lambda b: sig3(b / GIB)  # noqa: E731
    lines = []
    if plan is not None:
        what = {"full": "the block input", "selective": "the block input and the CP attention's q, k, v, output, lse",
                "none": "every saved activation"}[plan.checkpointing]
        lines.append(f"activation offload {plan.mode}: {plan.layers} blocks move {g(plan.per_layer)} GiB each ({what}) "
                     f"to {'pinned ' if plan.cuda else ''}host memory and back, {g(plan.traffic_bytes)} GiB each way "
                     f"per micro-batch; on the device the last block's and a prefetch window of "
                     f"{1 + PREFETCH_LAYERS} blocks")
        if not plan.cuda:
            lines[0] += " (on CPU host and device are one memory: nothing is saved)"
    if staging:
        lines.append(f"checkpoint.async_save: a {'pinned ' if cuda else ''}host copy of the rank's parameters and "
                     f"optimizer state, {g(staging)} GiB per rank, kept for the run")
    per_rank = (plan.host_bytes if plan is not None else 0) + staging
    node = ranks_per_node * per_rank
    fits = host is None or node <= host.usable_gib * GIB
    where = (f" of {sig3(host.usable_gib)} GiB usable ({100 * HOST_USABLE_FRACTION:.0f}% of {host.gib_per_node:g} GiB, "
             f"{host.source})" if host else "")
    lines.append(f"host memory: {g(per_rank)} GiB per rank, {g(node)} GiB per node of {ranks_per_node} "
                 f"rank(s){where}{'' if fits else ': does NOT fit the host'}")
    return lines, fits, node


def shrink_hint(config: Config, worst: RankMemory, accumulation: int = 1) -> str:
    """What to change, the largest part first: the state and its transient copies (sharding, the FSDP reduction,
    fewer micro-batches) or the activations (checkpointing, activation offload, sequence parallelism, tokens per
    rank)."""
    model, parallel, train = config.model, config.parallel, config.train
    if not parallel.fsdp:
        state = ["--fsdp (shards parameters, gradients and optimizer state over dp x cp)",
                 "a larger parallel.tp (splits the weights)"]
    else:
        state = ([] if parallel.fsdp_reshard_after_forward else
                 ["parallel.fsdp_reshard_after_forward=true (gathers one block at a time)"])
        state += ["a larger parallel.tp (splits the weights)", "more ranks in dp (FSDP shards over dp x cp)"]
        if accumulation > 1 and parallel.fsdp_reduce != "per_microbatch":  # unsharded gradients of every parameter
            state[:0] = ["parallel.fsdp_reduce=per_microbatch (no unsharded gradients between micro-batches)",
                         f"fewer, larger micro-batches (train.micro_batch_size={train.micro_batch_size * accumulation}"
                         f": one per step keeps no unsharded gradients, but more activations)"]
    acts = {"none": ["model.activation_checkpointing=selective (recomputes all but the attention; or full)"],
            "selective": ["model.activation_checkpointing=full"], "full": []}[model.activation_checkpointing]
    if model.activation_offload == "none":  # checkpointed: after full checkpointing, the largest lever at length
        acts.append("model.activation_offload=checkpointed (what checkpointing keeps to pinned host memory, back a "
                    "block ahead of its backward)" if model.activation_checkpointing != "none" else
                    "model.activation_offload=all (every saved activation to pinned host memory)")
    if parallel.tp > 1 and not parallel.sequence_parallel_on:
        acts.insert(0, "parallel.sequence_parallel=true (the residual stream and the norms hold 1/tp of the tokens)")
    acts += [] if model.loss_chunk_tokens else ["model.loss_chunk_tokens=1024 (no [tokens, vocab] logits)"]
    if model.activation_checkpointing == "none":  # checkpointed slices: only outside a checkpointed block
        acts.append(f"model.mlp_chunks={2 * model.mlp_chunks}")
    if train.micro_batch_size > 1:
        acts.append(f"train.micro_batch_size={train.micro_batch_size // 2} (activations scale with it)")
    acts += ["a larger parallel.cp (fewer tokens per rank)", "a smaller data.seq_len"]
    parts = [state, acts] if worst.state_bytes + worst.gathered_bytes >= worst.activation_bytes else [acts, state]
    return "; ".join(parts[0] + parts[1][:2])
