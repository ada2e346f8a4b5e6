"""The CP algorithms by name, and the checks of whether one can run (no kernels, no process groups).

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
