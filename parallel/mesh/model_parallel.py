"""What the model computes on: the CP groups (``CPGroups``) and the model's parallel settings (``ModelParallel``).

``ModelParallel`` is built and validated once (``ModelParallel.build``, or ``ParallelState.model_parallel``)
and passed whole to the model and its layers, which trust it: the TP group, the CP groups, the CP layout the
tokens arrive in and the CP algorithm that attends (a ``CPAlgorithm``, resolved from its name here, once), with
the sizes and ranks read once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from cp_train.parallel.cp.algorithms.registry import CPAlgorithm, get_cp_algorithm
from cp_train.parallel.cp.layout import check_layout_name


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


_GRAD_GROUPS: dict[dist.ProcessGroup, dist.ProcessGroup] = {}  # a ring group -> the communicator of its dK/dV hops


def register_grad_group(group: dist.ProcessGroup, twin: dist.ProcessGroup | None) -> None:
    """The ring's dK/dV hops over ``group`` go on ``twin``, a second communicator over the same ranks
    (``cp/ring/comm.py``; None: forget ``group``'s). The parallel state registers its ring group's twin."""
    if twin is None:
        _GRAD_GROUPS.pop(group, None)
    else:
        _GRAD_GROUPS[group] = twin


def grad_group_of(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The communicator of the dK/dV hops of a ring over ``group``: its twin, or ``group`` itself."""
    return _GRAD_GROUPS.get(group, group)


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


@dataclass(frozen=True)
class ModelParallel:
    """The model's parallel settings, validated once. ``tp_group`` None: no TP; ``cp.cp`` None: no CP.
    ``layout`` is the CP layout of the tokens (``cp_train.parallel.cp.layout``) and ``algorithm`` the CP
    algorithm (at cp 1 every algorithm is the local kernel)."""

    tp_group: dist.ProcessGroup | None
    cp: CPGroups
    layout: str
    algorithm: CPAlgorithm
    tp_size: int
    tp_rank: int
    cp_size: int
    cp_rank: int
    sequence_parallel: bool = False  # tp > 1 only: the blocks' inputs are this TP rank's 1/tp of the local tokens

    @classmethod
    def build(cls, tp_group: dist.ProcessGroup | None = None, cp_group: dist.ProcessGroup | CPGroups | None = None,
              layout: str = "zigzag", algorithm: str | CPAlgorithm = "ring", sequence_parallel: bool = False
              ) -> ModelParallel:
        """Validate and freeze the settings; ``ValueError`` saying what to change (an unknown layout or
        algorithm, hybrid without its Ulysses and ring subgroups). ``sequence_parallel`` takes effect at tp > 1."""
        check_layout_name(layout)
        groups = cp_group if isinstance(cp_group, CPGroups) else CPGroups(cp_group)
        cp_size, cp_rank = _size_and_rank(groups.cp)
        algorithm = get_cp_algorithm(algorithm)
        if cp_size > 1 and algorithm.subgroups:
            algorithm.check(cp_size, groups.ulysses_size)
        tp_size, tp_rank = _size_and_rank(tp_group)
        return cls(tp_group, groups, layout, algorithm, tp_size, tp_rank, cp_size, cp_rank,
                   sequence_parallel and tp_size > 1)

    @property
    def attention_layout(self) -> str:
        """The layout the attention and the positions use: ``layout``, or contiguous without CP (all alike)."""
        return self.layout if self.cp_size > 1 else "contiguous"

    @property
    def ulysses_degree(self) -> int:
        """Ranks the attention heads are split over (``CPAlgorithm.head_degree``; 1 for ring and all-gather)."""
        return self.algorithm.head_degree(self.cp_size, self.cp.ulysses_size)

    def without_cp(self) -> ModelParallel:
        """The same TP settings with no CP: a rank computes whole sequences alone (the in-run CP check's reference,
        ``cp_train/runtime/cp_check.py``)."""
        return replace(self, cp=CPGroups(None), cp_size=1, cp_rank=0)
