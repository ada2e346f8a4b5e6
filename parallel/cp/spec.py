"""How one context-parallel attention call site runs, decided once: the frozen ``AttentionSpec`` and
``build_spec``, which makes it (the kernel, the scale and the ring's head chunks and overlap by default).

The algorithm it names is a ``CPAlgorithm`` (``algorithms/``); the groups it runs on are ``CPGroups``
(``cp_train.parallel.mesh.model_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cp_train.parallel.cp.algorithms.registry import CPAlgorithm, get_cp_algorithm
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.kernels.select import BACKENDS, AttentionKernel, select_kernel


@dataclass(frozen=True)
class AttentionSpec:
    """One call site's settings, decided once: ``algorithm``, CP ``layout``, ``causal``, softmax ``scale``,
    the ``kernel``, the kv-head ``head_chunks`` (the ring's backward and the all-gather), the ring backward's
    ``overlap`` policy, whether the steps the documents shape run as ``varlen`` calls (the kernel has its own:
    ``ring/forward.py``; else their dense calls on views), whether only their full pieces do (``rectangles``:
    ``cudnn_ragged``, its causal squares on ragged graphs) and the ring forward's ``forward_head_chunks``.

    The ring's forward runs in one head chunk unless asked otherwise: chunks bound the K/V it receives,
    but a training step's backward holds dq, dk and dv whole, which is at least that, and an eval forward
    keeps no activations, so chunking the forward lowers no peak and costs a copy and a kernel call per chunk
    (3-5% of the forward on CPU at cp=2)."""

    algorithm: CPAlgorithm
    layout: str
    causal: bool
    scale: float
    kernel: AttentionKernel
    head_chunks: int
    overlap: bool
    varlen: bool = False
    forward_head_chunks: int = 1
    rectangles: bool = False


def _many_small_calls(plan: CPPlan | None) -> bool:
    """Whether packed documents make each step many small kernel calls (the same on every rank)."""
    return plan is not None and plan.max_calls > 4


def constant_to_compile(fn: Callable[[], int]) -> Callable[[], int]:
    """``torch.compiler.assume_constant_result`` without importing Dynamo (about half a second of every start,
    compiled or not): that decorator marks ``fn`` and returns it, and this sets the same mark (a test compares
    them)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_to_compile
def _cpu_threads() -> int:
    """The intra-op thread count; a constant to ``torch.compile`` (it sizes head chunks: speed, not results)."""
    return torch.get_num_threads()


def default_head_chunks(device: torch.device, kv_heads: int, plan: CPPlan | None = None,
                        rows_per_kv_head: int = 1) -> int:
    """The ring backward's (and the all-gather's) kv-head chunks; the ring forward runs in one
    (``AttentionSpec``). Two on GPUs, so that the backward's last dK/dV hop of one chunk travels during the next chunk's
    compute. On CPU as many chunks as leave every thread work: PyTorch's CPU flash backward spreads its
    threads over (batch x query heads) only, and ``rows_per_kv_head`` is that product per kv head; at one
    thread per rank that is one kv head per chunk, which bounds the transient buffers at no speed cost.
    One chunk without a ring (one rank: nothing travels) and when packed documents make many small calls
    (small calls run slower, and their buffers are small anyway). The same on every rank."""
    if device.type != "cpu":
        return min(2, kv_heads)
    if _many_small_calls(plan) or (plan is not None and len(plan.areas) == 1):
        return 1
    per_chunk = -(-_cpu_threads() // max(1, rows_per_kv_head))
    return max(1, kv_heads // per_chunk)


def default_overlap(device: torch.device, plan: CPPlan | None = None) -> bool:
    """The ring backward's overlap policy (see ``ring/backward.py``): on for GPUs; on CPU only with packed documents.
    There a rank's split of work between the local and the remote steps differs from its neighbours' even
    when the totals match (the balanced layout), so hops that wait in place would make every step as slow
    as its slowest rank; posted early, only the totals count, and the hops carry few rows. With one
    document every step is equal on every rank and memory comes first."""
    return device.type != "cpu" or _many_small_calls(plan)


RING_SM_MARGIN = 8  # SMs FA3 leaves to NCCL while CP traffic is in flight (TransformerEngine's CP does the same)


def transfer_kernel(kernel: AttentionKernel, plan: CPPlan | None) -> AttentionKernel:
    """``kernel`` as a call site whose kernel calls overlap CP communication runs it: FA3 with
    ``RING_SM_MARGIN`` SMs left free when more than one rank computes (a ring step's transfer, the
    all-gather's and Ulysses' collectives); any other kernel, or one rank, as it is."""
    if plan is None or len(plan.areas) < 2 or not hasattr(kernel, "with_sm_margin"):
        return kernel
    return kernel.with_sm_margin(RING_SM_MARGIN)


def build_spec(device: torch.device, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, head_dim: int, *,
               algorithm: str | CPAlgorithm = "ring", layout: str = "zigzag", causal: bool = True,
               softmax_scale: float | None = None, backend: str | None = None, head_chunks: int | None = None,
               deterministic: bool | None = None, overlap: bool | None = None,
               plan: CPPlan | None = None) -> AttentionSpec:
    """The spec of a call site whose q is ``[batch, n, heads, head_dim]`` of ``dtype`` on ``device`` and whose
    k/v have ``kv_heads`` heads (the arguments as ``context_parallel_attention`` takes them). ``ValueError`` for
    an unknown backend, ``KernelUnavailable`` for one that cannot run these inputs."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    batch = 1 if plan is not None and plan.packed else batch  # packed plans fold the batch into rows
    forward_head_chunks = head_chunks or 1  # asked for: both ways; by default the forward runs in one
    if head_chunks is None:
        head_chunks = default_head_chunks(device, kv_heads, plan, batch * heads // kv_heads)
    kernel = transfer_kernel(select_kernel(device, dtype, head_dim, backend, deterministic), plan)
    return AttentionSpec(
        algorithm=get_cp_algorithm(algorithm), layout=layout, causal=causal,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim), kernel=kernel,
        head_chunks=head_chunks, overlap=default_overlap(device, plan) if overlap is None else overlap,
        varlen=kernel.native_varlen, forward_head_chunks=forward_head_chunks,
        rectangles=getattr(kernel, "varlen_rectangles", False))
