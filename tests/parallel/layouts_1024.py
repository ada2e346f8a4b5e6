"""A 1,024-rank layout built on one CPU with PyTorch's fake process group, rank after rank.

    python -m tests.parallel.layouts_1024 [--tp 8 --cp 16 --dp 8 --dp-replicate 2 --model llama3-70b] [--workers 2]

For every rank: ``initialize_parallel`` builds the named mesh and every group (TP, CP, DP, DP x CP, TP x CP,
the ring's dK/dV twin, HSDP's shard and replicate groups), each checked against the pure rank-group functions
(``compute_rank_groups``); for the first, a middle and the last rank also the model on the meta device with
FSDP (HSDP when ``--dp-replicate`` > 1), its shards checked against the dry run's shapes, and the rank's CP
plan of one step at ``--seq``. The ranks are split over ``--workers`` forked processes (every rank is
independent: each builds its own fake world). Prints one JSON line (``seconds``, ranks checked, the groups' sizes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from cp_train.memory.dry_run import local_shapes
from cp_train.model.meta import meta_model
from cp_train.model.parallelize import shard_with_fsdp
from cp_train.model.shards import local_tensor
from cp_train.parallel.cp.plan.batch_plan import layout_plan
from cp_train.parallel.mesh import state as parallel_state
from cp_train.parallel.mesh.rank_groups import ParallelDims, compute_rank_groups
from cp_train.perf.inputs.presets import model_preset


def _member(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    found = [group for group in groups if rank in group]
    assert len(found) == 1, f"rank {rank} is in {len(found)} groups"
    return found[0]


def check_rank(rank: int, dims: ParallelDims, replicas: int, model: str | None, seq: int) -> None:
    """Build ``rank``'s state on the fake group, check its groups (and with ``model`` its FSDP shards and CP plan)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
    try:
        state = parallel_state.initialize_parallel(tp=dims.tp, cp=dims.cp, dp=dims.dp, dp_replicate=replicas)
        pure = compute_rank_groups(dims.world, dims.tp, dims.cp, dims.dp, dp_replicate=replicas)
        for name, axis in (("tp", state.tp), ("cp", state.cp), ("dp", state.dp), ("dp_cp", state.dp_cp),
                           ("tp_cp", state.tp_cp), ("dp_shard_cp", state.fsdp_shard), ("cp", state.cp_grad),
                           ("dp_replicate", state.dp_replicate_axis)):
            if axis is None:
                assert name == "dp_replicate" and replicas == 1 or name == "cp" and dims.cp == 1, name
                continue
            expected = _member(getattr(pure, name), rank) if name != "dp_shard_cp" or replicas > 1 else \
                _member(pure.dp_cp, rank)
            assert axis.ranks == expected and axis.rank == expected.index(rank), (rank, name, axis.ranks, expected)
        cp = state.cp.ranks
        assert (state.cp_prev_rank, state.cp_next_rank) == (cp[(state.cp.rank - 1) % dims.cp],
                                                            cp[(state.cp.rank + 1) % dims.cp])
        if model is not None:
            _check_model(state, dims, replicas, rank, model, seq)
        parallel_state.destroy_parallel()
    finally:
        dist.destroy_process_group()


def _check_model(state: parallel_state.ParallelState, dims: ParallelDims, replicas: int, rank: int, name: str,
                 seq: int) -> None:
    """The meta model with FSDP (HSDP) on this rank: every shard of the dry run's shape; the CP plan of a step."""
    config = model_preset(name)
    model = meta_model(config, state.model_parallel("zigzag", "ring"))
    full = dict(meta_model(config).named_parameters())
    shard_with_fsdp(model, state.fsdp_mesh)
    for param_name, param in model.named_parameters():
        assert local_tensor(param).shape == local_shapes(full[param_name], dims, rank, True, replicas)[0], param_name
    plan = layout_plan("ring", "zigzag", dims.cp, state.cp.rank, seq // dims.cp).ring
    assert plan.world == dims.cp and len(plan.steps) == dims.cp and plan.rows == seq // dims.cp


def check_ranks(ranks: range, dims: ParallelDims, replicas: int, model: str, seq: int) -> tuple[int, int]:
    """``check_rank`` for each of ``ranks``, the model on the first, a middle and the last rank of the world;
    (ranks checked, models checked)."""
    torch.set_num_threads(1)
    with_model = {0, dims.world // 2 + 3, dims.world - 1}
    for rank in ranks:
        check_rank(rank, dims, replicas, model if rank in with_model else None, seq)
    return len(ranks), len(with_model.intersection(ranks))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--dp-replicate", type=int, default=2)
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    dims = ParallelDims(tp=args.tp, cp=args.cp, dp=args.dp)
    started = time.perf_counter()
    check = partial(check_ranks, dims=dims, replicas=args.dp_replicate, model=args.model, seq=args.seq)
    shares = [range(worker, dims.world, args.workers) for worker in range(args.workers)]
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        checked, models = (sum(counts) for counts in zip(*pool.map(check, shares), strict=True))
    result = {"world": dims.world, "tp": dims.tp, "cp": dims.cp, "dp": dims.dp, "dp_replicate": args.dp_replicate,
              "ranks_checked": checked, "models_checked": models, "model": args.model,
              "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
