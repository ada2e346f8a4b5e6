"""The host's part of a GPU step: the time the GPU waits while the host dispatches ops and builds cuDNN graphs.

**Dispatch**: every op costs the profile's ``host_op_us`` (Python, autograd, the dispatcher, the launch), charged
in full (the trainer's own H100 and H200 steps ran 0.3-0.7 s longer than their kernels, the GPU idle for a quarter
of the step: docs/benchmarks.md). The ops per layer and micro-batch, forward + backward, were counted with a
dispatch mode over ``Trainer.train_step`` of cpu-tiny variants at cp 1 (torch 2.13, 2026-11-26): a block 250; TP
60 with sequence parallelism, 10 without; FSDP2's hooks 56, DDP's 10; full checkpointing 40% of the block again,
selective 102, each ``mlp_chunks`` slice 73. Outside the blocks 43 per micro-batch (+42 with sequence parallelism,
+16 TP without it), 300 per step. A compiled block dispatches ``COMPILED_SHARE`` of its eager ops (the profiler's
aten events of a compiled against an eager ``GPTModel`` forward + backward at cp 1, 917 / 2,686, 2026-11-28).

**cuDNN graphs**: cuDNN's attention builds an execution graph per new shape, forward and backward apart,
``graph_build_ms`` each. The ring routes the steps packed documents shape to varlen calls (``route_by_documents``),
so its dense calls take the layout's few block shapes, built at the first step (the ring's warm-up,
``parallel/cp/ring/warm.py``) and never again: counted here are the dense shapes per rank and micro-batch over the
planned samples outside those (none today; before the routing, a step of one or two documents ran a dense call per
document, a new shape in almost every micro-batch: 0.4 s per step at 16k in the 1B runs).
"""

from __future__ import annotations

from functools import lru_cache

from cp_train.config.schema import Config
from cp_train.parallel.cp.algorithms.registry import CPAlgorithm, get_cp_algorithm
from cp_train.parallel.cp.plan.routing import layout_shapes
from cp_train.perf.inputs.documents import consecutive_samples, rank_plans
from cp_train.perf.workload import Workload

LAYER = 250.0
TP_SP, TP_PLAIN = 60.0, 10.0
DDP, FSDP = 10.0, 56.0
FULL_RECOMPUTE, SELECTIVE_RECOMPUTE, MLP_SLICE = 0.40, 102.0, 73.0
ROOT, ROOT_TP_SP, ROOT_TP_PLAIN = 43.0, 42.0, 16.0
STEP = 300.0
COMPILED_SHARE = 917 / 2686
GRAPH_SAMPLES = 16  # samples planned for the count of new cuDNN shapes


def step_ops(config: Config, accumulation: int) -> float:
    """Ops the host dispatches in one optimizer step of ``accumulation`` micro-batches (see the module docstring)."""
    parallel, model = config.parallel, config.model
    block = LAYER + ((TP_SP if parallel.sequence_parallel_on else TP_PLAIN) if parallel.tp > 1 else 0.0)
    mode = model.activation_checkpointing
    recompute = {"full": FULL_RECOMPUTE * block, "selective": SELECTIVE_RECOMPUTE}.get(mode, 0.0)
    if mode == "none" and model.mlp_chunks > 1:
        recompute = MLP_SLICE * model.mlp_chunks
    share = COMPILED_SHARE if config.train.compile else 1.0
    hooks = FSDP if parallel.fsdp else (DDP if (parallel.dp or 1) * parallel.cp > 1 else 0.0)
    root = ROOT + ((ROOT_TP_SP if parallel.sequence_parallel_on else ROOT_TP_PLAIN) if parallel.tp > 1 else 0.0)
    return accumulation * (model.num_layers * (share * (block + recompute) + hooks) + root) + STEP


@lru_cache(maxsize=256)
def new_shapes_per_micro_batch(algorithm: CPAlgorithm, layout: str, cp: int, ulysses: int, seq_len: int,
                               documents: tuple[int, ...]) -> float:
    """Distinct dense call shapes per rank and micro-batch over ``GRAPH_SAMPLES`` samples cut from ``documents``
    (the busiest rank) outside the layout's block shapes and the one-document plan's: the shapes the documents
    give the dense calls of the steps not routed to varlen calls."""
    samples = consecutive_samples(documents, seq_len, GRAPH_SAMPLES)
    static = _dense_shapes(rank_plans(algorithm, layout, cp, ulysses, (seq_len,), seq_len))
    bounded = {(rows, keys) for rows, keys in layout_shapes(seq_len // cp)}
    per_rank = [set() for _ in range(cp)]
    for pieces in dict.fromkeys(samples):  # each distinct sample once (documents of one length give one)
        for rank, shapes in enumerate(_dense_shapes(rank_plans(algorithm, layout, cp, ulysses, pieces, seq_len))):
            per_rank[rank] |= {s for s in shapes - static[rank] if s[:2] not in bounded}
    return max(len(shapes) for shapes in per_rank) / len(samples)


def _dense_shapes(plans: list) -> list[set[tuple[int, int, bool]]]:
    return [{(c.segment.rows, c.segment.keys, c.segment.causal) for step in plan.ring.steps
             if not step.by_documents for c in step.calls} if plan.ring else set() for plan in plans]


def host_seconds(work: Workload, host_op_us: float, graph_build_ms: float, kernel: str,
                 documents: tuple[int, ...] | None) -> float:
    """Seconds per optimizer step the GPU waits for the host: every dispatched op at ``host_op_us`` and, on the
    ``cudnn`` kernel with packed ``documents``, two graphs (forward, backward) per new shape at ``graph_build_ms``."""
    config = work.config
    seconds = step_ops(config, work.accumulation) * host_op_us * 1e-6
    if documents and kernel == "cudnn" and config.data.document_mask:
        p = config.parallel
        shapes = new_shapes_per_micro_batch(get_cp_algorithm(p.cp_algorithm), p.cp_layout, p.cp, p.ulysses_size,
                                            config.data.seq_len, tuple(documents))
        seconds += work.accumulation * work.batch * shapes * 2 * graph_build_ms * 1e-3
    return seconds
