"""How a context-parallel attention call runs: the algorithm, its groups, and one frozen spec.

Algorithms (Megatron-Core's ``cp_comm_type`` names are accepted as aliases):

- ``ring`` (``p2p``): K/V blocks travel the CP ring while each rank keeps its queries.
- ``allgather`` (``all_gather``): every rank gathers the whole K/V (in head chunks) and attends its own
  queries; the backward reduce-scatters dK/dV (Llama 3's context parallelism).
- ``ulysses`` (``a2a``): an all-to-all turns sequence shards into head shards, each rank attends the
  whole sequence for its heads, and an all-to-all turns them back (DeepSpeed-Ulysses).
- ``hybrid`` (``a2a+p2p``): Ulysses inside groups of ``ulysses_size`` adjacent CP ranks, the ring across
  those groups (USP; Megatron's hierarchical context parallelism).

Every algorithm takes the same CP layout of the tokens and the same document masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from cp_train.parallel.kernels.select import AttentionKernel

ALGORITHMS: tuple[str, ...] = ("ring", "allgather", "ulysses", "hybrid")
ALIASES = {"p2p": "ring", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "hybrid"}


def canonical_algorithm(name: str) -> str:
    """``name`` or its Megatron alias as one of ``ALGORITHMS``; ValueError listing the choices."""
    if name in ALGORITHMS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"unknown CP algorithm {name!r}; choose one of {', '.join(ALGORITHMS)} "
                     f"(or Megatron's {', '.join(ALIASES)})")


def check_algorithm(algorithm: str, cp: int, ulysses_size: int) -> None:
    """ValueError naming the keys when ``algorithm`` cannot run at this cp / ulysses_size."""
    if algorithm == "hybrid" and not 1 < ulysses_size < cp:
        raise ValueError(f"parallel.cp_algorithm=hybrid needs 1 < parallel.ulysses_size < parallel.cp, got "
                         f"ulysses_size {ulysses_size} at cp {cp}: use cp_algorithm=ulysses for ulysses_size = cp, "
                         f"ring for 1")
    if ulysses_size > 1 and algorithm != "hybrid":
        raise ValueError(f"parallel.ulysses_size {ulysses_size} is only used by parallel.cp_algorithm=hybrid "
                         f"(got {algorithm}); set ulysses_size=1")


def check_heads(algorithm: str, heads: int, kv_heads: int, degree: int) -> None:
    """ValueError naming the numbers unless the heads (per TP rank) split over the Ulysses ``degree``."""
    if algorithm not in ("ulysses", "hybrid") or degree == 1:
        return
    if heads % degree:
        raise ValueError(f"{algorithm} CP splits attention heads over {degree} ranks: the {heads} query heads per "
                         f"TP rank are not divisible by {degree}; change num_heads, tp or the Ulysses degree")
    if kv_heads % degree and degree % kv_heads:
        raise ValueError(f"{algorithm} CP splits attention heads over {degree} ranks: the {kv_heads} kv heads per "
                         f"TP rank neither divide nor are divisible by {degree}; change num_kv_heads, tp or "
                         f"the Ulysses degree")


@dataclass(frozen=True)
class CPGroups:
    """The process groups a CP algorithm uses: ``cp`` (all CP ranks; None: no CP), and for ``hybrid`` the
    ``ulysses`` (adjacent CP ranks) and ``ring`` (across Ulysses groups) subgroups."""

    cp: dist.ProcessGroup | None
    ulysses: dist.ProcessGroup | None = None
    ring: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.cp) if self.cp is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.cp) if self.cp is not None else 0

    @property
    def ulysses_size(self) -> int:
        return dist.get_world_size(self.ulysses) if self.ulysses is not None else 1


@dataclass(frozen=True)
class AttentionSpec:
    """One call site's settings, decided once: ``algorithm``, CP ``layout``, ``causal``, softmax ``scale``,
    the ``kernel``, the kv-head ``head_chunks`` (the ring's backward and the all-gather), the ring backward's
    ``overlap`` policy, whether steps of many segments run as ``varlen`` calls (``parallel/ring_core.py``)
    and the ring forward's ``forward_head_chunks``.

    The ring's forward runs in one head chunk unless asked otherwise: chunks bound the K/V it receives,
    but a training step's backward holds dq, dk and dv whole, which is at least that, and an eval forward
    keeps no activations, so chunking the forward lowers no peak and costs a copy and a kernel call per chunk
    (3-5% of the forward on CPU at cp=2)."""

    algorithm: str
    layout: str
    causal: bool
    scale: float
    kernel: AttentionKernel
    head_chunks: int
    overlap: bool
    varlen: bool = False
    forward_head_chunks: int = 1
