"""The CP algorithms by name: the ``CPAlgorithm`` interface every algorithm implements, and its registry.

A CP algorithm says how attention over a CP group runs and what it costs: it checks its inputs (``check``,
``check_heads``), makes a batch's plan (``plan``), gives the autograd Function that runs it (``call``, run
inside the ``cp_train::attention`` operator), and reports the K/V rows it receives, the memory it keeps and
holds (the dry run) and its kernel calls and communication (the planner). The built-in algorithms:

- ``ring`` (Megatron's ``p2p``): K/V blocks travel the CP ring while each rank keeps its queries;
- ``allgather`` (``all_gather``): every rank gathers the whole K/V in head chunks and attends its own queries;
  the backward reduce-scatters dK/dV (Llama 3's context parallelism);
- ``ulysses`` (``a2a``): an all-to-all turns sequence shards into head shards (DeepSpeed-Ulysses);
- ``hybrid`` (``a2a+p2p``): Ulysses inside groups of ``ulysses_size`` adjacent CP ranks, the ring across them.

``register_cp_algorithm(name, algorithm)`` adds one (a new algorithm is a module and this call);
``get_cp_algorithm(name)`` resolves a name or alias once, at the config's boundary: below it, code holds the
algorithm object and asks it, never its name. The built-ins are imported on first lookup, so that holding the
registry loads no kernel. Every algorithm takes the same CP layouts and document masks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CPPlan = Any  # ``cp_train.parallel.cp.plan.batch_plan.CPPlan`` (which holds its algorithm: not imported here)

BUILT_IN = {"ring": ("p2p",), "allgather": ("all_gather",), "ulysses": ("a2a",), "hybrid": ("a2a+p2p",)}
ALGORITHMS = tuple(BUILT_IN)  # the built-in algorithms' names


class CPAlgorithm:
    """One CP algorithm (see the module docstring). Subclasses set ``name`` and implement ``plan``, ``call``,
    ``kv_rows_received``, ``buffer_bytes`` and ``attention_work``; the defaults below fit an algorithm that keeps
    every head on every rank."""

    name: str = ""
    subgroups: bool = False  # needs CPGroups' Ulysses and ring subgroups (``ulysses_size`` ranks each)
    gathers_kv: bool = False  # K/V arrive in one gather per layer, overlapped chunk by chunk (not hop by hop)

    def head_degree(self, cp: int, ulysses_size: int) -> int:
        """Ranks the attention heads are split over (1: every rank attends all its heads)."""
        return 1

    def ring_size(self, cp: int, ulysses_size: int) -> int:
        """Ranks K/V blocks travel among (1: none)."""
        return cp

    def check(self, cp: int, ulysses_size: int) -> None:
        """``ValueError`` naming the keys when the algorithm cannot run at this cp and ``ulysses_size``."""
        if ulysses_size > 1:
            raise ValueError(f"parallel.ulysses_size {ulysses_size} is only used by parallel.cp_algorithm=hybrid "
                             f"(got {self.name}); set ulysses_size=1")

    def check_heads(self, heads: int, kv_heads: int, cp: int, ulysses_size: int) -> None:
        """``ValueError`` naming the numbers unless the heads per TP rank split over ``head_degree`` ranks."""
        degree = self.head_degree(cp, ulysses_size)
        if degree == 1:
            return
        if heads % degree:
            raise ValueError(f"{self.name} CP splits attention heads over {degree} ranks: the {heads} query heads "
                             f"per TP rank are not divisible by {degree}; change num_heads, tp or the Ulysses degree")
        if kv_heads % degree and degree % kv_heads:
            raise ValueError(f"{self.name} CP splits attention heads over {degree} ranks: the {kv_heads} kv heads "
                             f"per TP rank neither divide nor are divisible by {degree}; change num_kv_heads, tp or "
                             f"the Ulysses degree")

    def plan(self, tokens: Any, rank: int, ulysses: int, causal: bool, window: Any) -> CPPlan:
        """This rank's plan of a batch from every rank's ``tokens`` (``batch_plan._Tokens``)."""
        raise NotImplementedError

    def one_document(self, plan: CPPlan, world: int, local_len: int, causal: bool, window: Any) -> CPPlan:
        """The plan of one document per sample in a static layout, from ``plan`` (made by ``plan``)."""
        return plan

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Any, spec: Any, plan: CPPlan | None,
             sinks: torch.Tensor | None) -> tuple[type[torch.autograd.Function], tuple]:
        """The autograd Function that attends over ``groups`` (``CPGroups``, more than one rank) and its ``apply``
        arguments."""
        raise NotImplementedError

    def kv_rows_received(self, plan: CPPlan, local_len: int) -> int:
        """K/V rows this rank receives in one attention forward of ``plan`` (of one sample, or of the folded batch
        when the plan is packed; ``local_len`` rows per rank and sample)."""
        raise NotImplementedError

    def kv_head_share(self, plan: CPPlan) -> int:
        """The received rows carry ``1 / kv_head_share`` of the kv heads (Ulysses: the rank's share)."""
        return 1

    def kept_bytes(self, s: Any) -> int:
        """Bytes the attention keeps for the backward beyond q, k, v, output and lse (``costs.Shapes``)."""
        return 0

    def buffer_bytes(self, s: Any, backward: bool) -> int:
        """The transient working set of its forward or ``backward`` beyond the output, the incoming gradient and
        the fp32 dq, dk, dv (``costs.Shapes``)."""
        raise NotImplementedError

    def attention_work(self, work: Any) -> tuple[list[list[Any]], int, list[Any]]:
        """The planner's view of one layer and sample (``costs.WorkInputs``): every CP rank's steps
        (``costs.AttentionStep``), the query heads a kernel call runs over and the collectives."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CPAlgorithm) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return self.name


_REGISTRY: dict[str, CPAlgorithm] = {}
_ALIASES: dict[str, str] = {alias: name for name, aliases in BUILT_IN.items() for alias in aliases}


def register_cp_algorithm(name: str, algorithm: CPAlgorithm, aliases: tuple[str, ...] = ()) -> CPAlgorithm:
    """Make ``algorithm`` (a ``CPAlgorithm``) the one named ``name`` (and ``aliases``); returns it. Registering a
    name again replaces it."""
    if not isinstance(algorithm, CPAlgorithm):
        raise TypeError(f"register_cp_algorithm({name!r}, ...) needs a CPAlgorithm, got {type(algorithm).__name__}")
    algorithm.name = name
    _REGISTRY[name] = algorithm
    _ALIASES.update({alias: name for alias in aliases})
    return algorithm


def _load_built_in(name: str) -> None:
    if name in BUILT_IN and name not in _REGISTRY:
        importlib.import_module(f"cp_train.parallel.cp.algorithms.{name}")  # registers itself


def get_cp_algorithm(name: str | CPAlgorithm) -> CPAlgorithm:
    """The algorithm named ``name`` (or a Megatron alias: ``p2p``, ``all_gather``, ``a2a``, ``a2a+p2p``); an
    algorithm is returned as it is. ``ValueError`` listing the names otherwise."""
    if isinstance(name, CPAlgorithm):
        return name
    name = _ALIASES.get(name, name)
    _load_built_in(name)
    if name not in _REGISTRY:
        megatron = ", ".join(alias for aliases in BUILT_IN.values() for alias in aliases)
        raise ValueError(f"unknown CP algorithm {name!r}; choose one of {', '.join(cp_algorithm_names())} "
                         f"(or Megatron's {megatron}), or register yours with register_cp_algorithm in a module "
                         f"listed in train.imports")
    return _REGISTRY[name]


def cp_algorithm_names() -> list[str]:
    """Every algorithm's name: the built-ins first, then those registered."""
    return [*BUILT_IN, *(name for name in _REGISTRY if name not in BUILT_IN)]
