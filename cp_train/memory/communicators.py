"""The NCCL communicators a rank holds, their GPU buffers, and which groups cross nodes (for the dry run).

NCCL allocates its buffers per communicator and per connection: a collective's ring or tree uses two
connections per channel whatever the group size, and a send/receive or all-to-all one per peer, each with up to
32 channels on NVLink (NVIDIA/nccl#986: "memory usage is linearly tied to the number of channels; ring ... only has
2 connections regardless of the scale"; #1685: an all-to-all over 8 H100s grew each GPU's NCCL memory from 1.06 to
4.34 GB, 32 channels per pair; #864: about 1.6 GB with one communicator, 6 GB with three). The estimates here are
``COLLECTIVE_GIB`` per communicator that runs collectives and ``PEER_GIB`` per point-to-point or all-to-all peer,
counted for the groups the run uses; the dry run's reserve (``reserve_gib``) is meant to hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cp_train.config.schema import Config
from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.parallel.mesh.rank_groups import RankGroups, compute_rank_groups, crossing_nodes

COLLECTIVE_GIB = 0.5  # a communicator's ring/tree buffers (2 connections x up to 32 channels)
PEER_GIB = 0.45  # per point-to-point or all-to-all peer (#1685: 3.3 GB for 7 peers)


@dataclass(frozen=True)
class Communicators:
    """The communicators of one rank: ``(group kind, members, GiB)`` each, and the kinds that cross nodes."""

    used: tuple[tuple[str, int, float], ...]
    crossing: tuple[str, ...]
    ranks_per_node: int

    @property
    def gib(self) -> float:
        return sum(gib for _, _, gib in self.used)


def communicators(config: Config, dp: int, ranks_per_node: int) -> Communicators:
    """What a rank of ``config`` at DP size ``dp`` holds on nodes of ``ranks_per_node`` ranks."""
    parallel = config.parallel
    tp, cp = parallel.tp, parallel.cp
    world = tp * cp * dp
    replicas = parallel.dp_replicate if parallel.fsdp else 1
    groups: RankGroups = compute_rank_groups(world, tp, cp, dp, parallel.ulysses_size, replicas)
    used: list[tuple[str, int, float]] = []
    if tp > 1:
        used.append(("tp", tp, COLLECTIVE_GIB))
    if cp > 1:
        algorithm = get_cp_algorithm(parallel.cp_algorithm)
        ring = algorithm.ring_size(cp, parallel.ulysses_size)
        alltoall = cp // ring
        if ring > 1:  # the ring's two neighbours, and the plan's collectives on the same group
            used.append(("cp ring" if alltoall > 1 else "cp", ring, COLLECTIVE_GIB + 2 * PEER_GIB))
        if alltoall > 1:
            used.append(("cp all-to-all", alltoall, (alltoall - 1) * PEER_GIB))
    if dp * cp > 1:
        used.append(("dp_cp", dp * cp, COLLECTIVE_GIB))  # the loss, DDP's buckets or FSDP's gathers
    if replicas > 1:
        used.append(("fsdp shard", dp * cp // replicas, COLLECTIVE_GIB))
        used.append(("dp_replicate", replicas, COLLECTIVE_GIB))
    return Communicators(tuple(used), crossing_nodes(groups, ranks_per_node), ranks_per_node)


def communicator_lines(found: Communicators) -> list[str]:
    """The dry run's lines: the communicators and their buffers, and the groups that cross nodes."""
    if not found.used:
        return []
    each = ", ".join(f"{kind} ({ranks} ranks, {gib:.2g})" for kind, ranks, gib in found.used)
    lines = [f"NCCL communicators per rank: ~{found.gib:.2g} GiB of buffers (estimate; inside the reserve): {each}"]
    names = {"dp_shard_cp": "fsdp shard", "cp_ulysses": "cp all-to-all", "cp_ring": "cp ring"}
    crossing = [names.get(kind, kind) for kind in found.crossing]
    lines.append(f"groups crossing nodes ({found.ranks_per_node} ranks per node): "
                 f"{', '.join(crossing) if crossing else 'none'}")
    return lines
