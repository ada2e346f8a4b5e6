"""``train.check_replicas_every``: the replicas of the weights agree (Megatron-LM's
``--check-weight-hash-across-dp-replicas-interval``).

Every N-th step, after its update, each rank takes a fingerprint of every parameter it holds (its local tensor: TP's
shard; FSDP's shard under HSDP): the bit pattern of its elements as integers, summed in int64 with weights by
position (``fingerprint``: exact, so equal tensors give equal fingerprints on any device and in any order of
summation, and a flipped bit or a moved element changes it). The fingerprints go to every rank over the host group
(gloo, one all-gather of 8 bytes per tensor per rank), and each set of ranks that holds the same tensors is compared:
DP x CP without FSDP (DDP replicates the weights over both), HSDP's replicas with FSDP. Replicas that differ mean a
GPU computed or received something else (silent data corruption, a nondeterministic update): every rank stops with
the same line, naming the tensors and the ranks that differ from their replicas (``RunFailure``). The first check
that passes leaves a note. Cost per check: one read of the parameters on the device and one small gather.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from cp_train.config.schema import Config
from cp_train.errors import RunFailure
from cp_train.model.shards import local_tensor
from cp_train.parallel.compat import all_gather_single
from cp_train.parallel.mesh.state import ParallelState

CHUNK = 1 << 20  # elements per partial sum: |bits| < 2^31, weights <= 1021: a partial stays under 2^61
BLOCK = 1 << 24  # elements widened to int64 at a time (128 MiB)
MODULUS = (1 << 31) - 1  # each partial reduced below 2^31 before it is weighted by its chunk's index
INTEGER_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # by element size
HINT = ("a GPU computed or received something else (silent data corruption, or a nondeterministic update): resume "
        "from the last checkpoint without the node of the ranks named")


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``tensor``'s device: its elements' bit patterns weighted by position, summed exactly."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(INTEGER_VIEW[flat.element_size()])
    count = bits.numel()
    weights = torch.arange(min(CHUNK, count), dtype=torch.int64, device=flat.device) % 1021 + 1
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, count, BLOCK):
        block = bits[start:start + BLOCK].to(torch.int64)
        whole = block.numel() // CHUNK * CHUNK
        partials = [(block[:whole].view(-1, CHUNK) * weights).sum(dim=1)] if whole else []
        if whole < block.numel():  # the last chunk, short
            rest = block[whole:]
            partials.append((rest * weights[:rest.numel()]).sum().reshape(1))
        partial = torch.cat(partials) % MODULUS
        index = torch.arange(start // CHUNK + 1, start // CHUNK + 1 + partial.numel(), device=flat.device)
        total += (partial * index).sum()  # chunk indices < 2^12 per 2^32 elements: no overflow
    return total


def compare_replicas(rows: torch.Tensor, names: list[str]) -> tuple[dict[int, list[str]], int]:
    """``rows``: every rank's ``[replica set, fingerprint per tensor]`` (``[world, 1 + len(names)]``, by rank).
    Returns ``({rank: the tensors where it differs from its replicas}, the most replicas of a set)``: within a set,
    a rank differs where its fingerprint is not the one most of the set holds; without a majority (two replicas that
    disagree, say) every rank of the set is named for it."""
    sets: dict[int, list[int]] = {}
    for rank, key in enumerate(rows[:, 0].tolist()):
        sets.setdefault(key, []).append(rank)
    differing: dict[int, list[str]] = {}
    for ranks in sets.values():
        held = rows[ranks, 1:]
        if bool((held == held[:1]).all()):  # the usual case, without a loop over the tensors
            continue
        for column, name in enumerate(names, start=1):
            values = rows[ranks, column].tolist()
            common, count = Counter(values).most_common(1)[0]
            for rank, value in zip(ranks, values, strict=True):
                if value != common or 2 * count <= len(values):  # no majority: each is suspect
                    differing.setdefault(rank, []).append(name)
    return differing, max(len(ranks) for ranks in sets.values())


class ReplicaCheck:
    """The check of one run: ``config``'s ``train.check_replicas_every`` (0: off), the groups (``state``) and the
    ``model`` whose parameters (the sharded ones the optimizer updates) are compared."""

    def __init__(self, config: Config, state: ParallelState, model: nn.Module) -> None:
        self.every = config.train.check_replicas_every
        self.state = state
        self.named = [(name, param) for name, param in model.named_parameters()]
        hsdp = config.parallel.fsdp and state.dp_replicate_axis is not None
        replicas = state.dp_replicate_axis if hsdp else state.dp_cp
        self.group_name = "HSDP replicas" if hsdp else "dp x cp group"
        self.replica_set = min(replicas.ranks)  # names this rank's set of replicas
        self.passed = False

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @torch.no_grad()
    def after_step(self, step: int) -> str | None:
        """At a due step (after its update), compare the replicas (collective over every rank). Returns a note the
        first time they agree; ``RunFailure`` on every rank when any differ."""
        if not self.due(step):
            return None
        prints = torch.stack([fingerprint(local_tensor(param)) for _, param in self.named]).cpu()
        row = torch.cat([torch.tensor([self.replica_set], dtype=torch.int64), prints])
        world = dist.get_world_size(self.state.host_group)
        rows = torch.empty(world * row.numel(), dtype=torch.int64)
        all_gather_single(rows, row, group=self.state.host_group)
        rows = rows.view(world, row.numel())
        differing, copies = compare_replicas(rows, [name for name, _ in self.named])
        if differing:
            parts = [f"rank {rank}: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                     for rank, names in sorted(differing.items())]
            raise RunFailure(f"replica check at step {step}: the weights differ from their replicas' (the "
                             f"{self.group_name}) on {'; '.join(parts)}: {HINT}")
        if self.passed:
            return None
        self.passed = True
        return (f"replica check at step {step}: the {copies} replicas of the weights agree ({len(self.named)} "
                f"tensors, the {self.group_name}); checked every {self.every} steps")
