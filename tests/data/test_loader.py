"""DP sampling by consumed_samples and the CP split of every per-token tensor."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from cp_train import build
from cp_train.config.sources import build_config
from cp_train.data.gpt_dataset import PER_TOKEN_KEYS, GPTDataset
from cp_train.data.loader import (
    CP_PLAN,
    CollateForContextParallel,
    DataParallelSampler,
    build_data_loader,
    slice_for_context_parallel,
)
from cp_train.parallel.cp.balanced_layout import balanced_positions
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, gather_sequence, sequence_positions, unshard_sequence
from cp_train.parallel.cp.plan.batch_plan import SamplePlanner, plan_from_gathered
from tests.data.test_gpt_dataset import EOD, make_indexed


def _flatten(steps) -> list[int]:
    return [i for step in steps for micro in step for i in micro]


def _global_steps(total, mbs, gbs, dp_size, consumed=0) -> list[list[int]]:
    """Per step, the sorted sample ids of all DP ranks together."""
    per_rank = [list(DataParallelSampler(total, mbs, gbs, r, dp_size, consumed))
                for r in range(dp_size)]
    return [sorted(_flatten(ranks)) for ranks in zip(*per_rank, strict=True)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> GPTDataset:
    indexed = make_indexed(tmp_path_factory.mktemp("loader") / "docs", num_docs=40)
    return GPTDataset(indexed, 16, 96, seed=11, eod_id=EOD, mask_eod_loss=True,
                      reset_position_ids=True)


@pytest.mark.parametrize("mbs,gbs,dp", [(1, 4, 1), (2, 8, 2), (1, 12, 4), (3, 6, 2)])
def test_dp_ranks_are_disjoint_and_cover_each_global_batch(mbs, gbs, dp):
    total = 50
    samplers = [DataParallelSampler(total, mbs, gbs, r, dp) for r in range(dp)]
    assert samplers[0].grad_accum_steps == gbs // (mbs * dp)
    steps = [list(s) for s in samplers]
    assert all(len(s) == total // gbs for s in steps)
    for step, ranks in enumerate(zip(*steps, strict=True)):
        assert all(len(micro) == mbs for rank in ranks for micro in rank)
        ids = _flatten(ranks)
        assert len(ids) == len(set(ids)) == gbs
        assert sorted(ids) == list(range(step * gbs, (step + 1) * gbs))


def test_the_global_stream_does_not_depend_on_dp_size():
    reference = _global_steps(60, 1, 12, 1)
    for mbs, dp in [(2, 2), (1, 4), (3, 2), (6, 2)]:
        assert _global_steps(60, mbs, 12, dp) == reference


@pytest.mark.parametrize("consumed", [0, 8, 24, 40])
def test_resume_yields_the_tail_of_a_fresh_run(consumed):
    for rank in range(2):
        fresh = list(DataParallelSampler(50, 2, 8, rank, 2))
        resumed = list(DataParallelSampler(50, 2, 8, rank, 2, consumed_samples=consumed))
        assert resumed == fresh[consumed // 8:]


def test_resume_mid_batch_continues_the_sample_stream():
    """Resuming at any k (e.g. after a global batch size change) starts the stream at k."""
    fresh = _flatten([_global_steps(60, 1, 4, 2)])
    resumed = _flatten([_global_steps(60, 1, 4, 2, consumed=6)])
    assert resumed == fresh[6:6 + len(resumed)] and len(resumed) == 52


def test_sampler_errors():
    with pytest.raises(ValueError, match="multiple of micro_batch_size \\* dp_size = 4"):
        DataParallelSampler(50, 2, 6, 0, 2)
    with pytest.raises(ValueError, match="dp_rank 2 is outside"):
        DataParallelSampler(50, 2, 8, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples 60"):
        DataParallelSampler(50, 2, 8, 0, 2, consumed_samples=60)


@pytest.mark.parametrize("layout", STATIC_LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_slices_gather_back_to_the_sample(dataset, layout, cp):
    sample = dataset[3]
    batch = default_collate([dataset[i] for i in range(3)])
    for full in (sample, batch):
        slices = [slice_for_context_parallel(full, r, cp, layout) for r in range(cp)]
        for key in PER_TOKEN_KEYS:
            assert all(s[key].shape[-1] == 16 // cp for s in slices)
            assert torch.equal(unshard_sequence([s[key] for s in slices], layout, dim=-1), full[key])
    for rank in range(cp):  # every per-token tensor keeps the same global positions
        positions = sequence_positions(16, rank, cp, layout)
        local = slice_for_context_parallel(sample, rank, cp, layout)
        for key in PER_TOKEN_KEYS:
            assert torch.equal(local[key], sample[key][positions])


def test_balanced_slices_follow_each_samples_documents(dataset):
    """The balanced layout deals each sample's chunks by attention work; every per-token tensor (positions,
    labels, loss mask, document ids) follows the tokens, and the ranks together hold each sample once."""
    batch = default_collate([dataset[i] for i in range(3)])
    slices = [slice_for_context_parallel(batch, r, 2, "balanced") for r in range(2)]
    for b in range(3):
        expected = balanced_positions(batch["document_ids"][b], 2)
        for rank in range(2):
            for key in PER_TOKEN_KEYS:
                assert torch.equal(slices[rank][key][b], batch[key][b][expected[rank]]), key
        held = torch.cat([expected[0], expected[1]]).sort().values
        assert torch.equal(held, torch.arange(16))
    with pytest.raises(ValueError, match=r"sequence length 16 is not divisible by cp = 3"):
        slice_for_context_parallel(batch, 0, 3, "balanced")


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses", "hybrid"])
@pytest.mark.parametrize("layout", [*STATIC_LAYOUTS, "balanced"])
def test_collate_plans_from_the_whole_sample_as_the_gather_would(dataset, layout, algorithm):
    """With a planner the collate keeps the same slices and adds the plan that every rank's gathered document
    ids and positions give (what ``build_cp_plan`` computes after its all-gather)."""
    samples = [dataset[i] for i in range(3)]
    batch = default_collate(samples)
    cp = 4 if algorithm == "hybrid" else 2
    for rank in range(cp):
        planner = SamplePlanner(algorithm, cp, rank, 2 if algorithm == "hybrid" else 1)
        got = CollateForContextParallel(rank, cp, layout, planner)(samples)
        every = [slice_for_context_parallel(batch, r, cp, layout) for r in range(cp)]
        assert got.keys() == every[rank].keys() | {CP_PLAN}
        for key in PER_TOKEN_KEYS:
            assert torch.equal(got[key], every[rank][key]), key
        docs, positions = (torch.stack([part[key] for part in every]) for key in ("document_ids", "position_ids"))
        expected = plan_from_gathered(algorithm, cp, rank, planner.ulysses, True, docs, positions)
        assert repr(got[CP_PLAN]) == repr(expected)
        assert got[CP_PLAN].areas == expected.areas and sum(expected.areas) > 0
        counts = [torch.unique(row, return_counts=True)[1] for row in batch["document_ids"]]
        assert got[CP_PLAN].pairs == sum(int((c * (c + 1) // 2).sum()) for c in counts)  # the causal mask's


def test_loader_workers_hand_over_the_same_plans(dataset):
    """Plans made in a worker process (CUDA runs load with workers) travel pickled and arrive whole."""
    planner = SamplePlanner("hybrid", 4, 1, 2)
    inline, workers = (build_data_loader(dataset, 2, 4, cp_rank=1, cp_size=4, layout="balanced", num_workers=n,
                                         planner=planner) for n in (0, 1))
    for step_inline, step_workers in itertools.islice(zip(inline, workers, strict=True), 2):
        for a, b in zip(step_inline, step_workers, strict=True):
            assert repr(a[CP_PLAN]) == repr(b[CP_PLAN]) and torch.equal(a["tokens"], b["tokens"])


def test_cp_slice_of_plain_positions_is_the_layout(dataset):
    sample = dict(dataset[0], position_ids=torch.arange(16), extra="kept")
    for rank in range(2):
        local = slice_for_context_parallel(sample, rank, 2, "zigzag")
        assert torch.equal(local["position_ids"], sequence_positions(16, rank, 2, "zigzag"))
        assert local["extra"] == "kept"


def test_seq_len_must_split_over_cp(dataset):
    with pytest.raises(ValueError, match="sequence length 16 is shorter than 2\\*cp = 32"):
        slice_for_context_parallel(dataset[0], 0, 16, "zigzag")
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 12"):
        build_data_loader(dataset, 1, 4, cp_rank=0, cp_size=6)
    build_data_loader(dataset, 1, 4, cp_rank=0, cp_size=8, layout="stripe")  # 16 % 8 == 0
    with pytest.raises(ValueError, match="unknown CP layout 'ring'"):
        build_data_loader(dataset, 1, 4, layout="ring")
    with pytest.raises(ValueError, match="cp_rank 2 is outside"):
        build_data_loader(dataset, 1, 4, cp_rank=2, cp_size=2)


def test_cp_size_one_takes_any_seq_len():
    odd = {"tokens": torch.arange(7), "labels": torch.arange(1, 8)}
    for layout in STATIC_LAYOUTS:
        assert torch.equal(slice_for_context_parallel(odd, 0, 1, layout)["tokens"], odd["tokens"])


def test_loader_feeds_each_rank_its_slice_of_the_global_batch(dataset):
    mbs, gbs, dp, cp = 2, 8, 2, 2
    loaders = {(d, c): build_data_loader(dataset, mbs, gbs, d, dp, c, cp)
               for d, c in itertools.product(range(dp), range(cp))}
    steps = {key: list(itertools.islice(loader, 3)) for key, loader in loaders.items()}
    for d in range(dp):
        expected = list(DataParallelSampler(len(dataset), mbs, gbs, d, dp))[:3]
        for step in range(3):
            assert len(steps[(d, 0)][step]) == 2  # grad_accum micro-batches
            for m, ids in enumerate(expected[step]):
                parts = [steps[(d, c)][step][m] for c in range(cp)]
                full = default_collate([dataset[i] for i in ids])
                for key in PER_TOKEN_KEYS:
                    assert parts[0][key].shape == (mbs, 16 // cp)
                    assert torch.equal(unshard_sequence([p[key] for p in parts], "zigzag", dim=-1),
                                       full[key])
    assert loaders[(0, 0)].state_dict() == {"consumed_samples": 3 * gbs}


def test_resume_with_another_layout_continues_the_stream(dataset):
    fresh = build_data_loader(dataset, 2, 8, cp_size=2, cp_rank=0)
    first = list(itertools.islice(fresh, 2))
    assert fresh.consumed_samples == 16
    resumed = build_data_loader(dataset, 2, 8, cp_size=4, cp_rank=1, layout="stripe",
                                consumed_samples=fresh.state_dict()["consumed_samples"])
    step = next(iter(resumed))
    ids = DataParallelSampler(len(dataset), 2, 8, consumed_samples=16).step_micro_batches(16)[0]
    full = default_collate([dataset[i] for i in ids])
    assert torch.equal(step[0]["tokens"], full["tokens"][:, 1::4])
    assert len(first) == 2 and len(fresh) == 12 and len(resumed) == 10


def test_workers_give_the_same_batches(dataset):
    serial = list(itertools.islice(build_data_loader(dataset, 2, 4, cp_size=2, cp_rank=1), 3))
    parallel = list(itertools.islice(build_data_loader(dataset, 2, 4, cp_size=2, cp_rank=1,
                                                       num_workers=2), 3))
    for a, b in zip(serial, parallel, strict=True):
        assert all(torch.equal(a[0][k], b[0][k]) for k in PER_TOKEN_KEYS)


def _cp_ranks_read_one_global_sample(dataset: GPTDataset) -> bool:
    """On a spawned CP group: each rank loads its slice; gathering gives the global sample."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = next(iter(build_data_loader(dataset, 1, 2, cp_rank=rank, cp_size=world)))
    for m, micro in enumerate(step):
        full = dataset[m]
        for key in PER_TOKEN_KEYS:
            gathered = gather_sequence(micro[key].contiguous(), None, "zigzag", dim=-1)
            if not torch.equal(gathered[0], full[key]):
                return False
    return True


def test_spawned_cp_ranks_gather_the_global_sample(dataset, spawn_world):
    assert spawn_world(2).run(_cp_ranks_read_one_global_sample, dataset) == [True, True]


def test_gpu_runs_prefetch_into_pinned_memory(dataset):
    """On CUDA the trainer's loader prefetches with worker processes into pinned memory (non-blocking
    copies); on CPU it loads in the training process; an explicit data.num_workers wins."""


    axis = SimpleNamespace(rank=0, size=1)
    state = SimpleNamespace(dp=axis, cp=axis)
    config = build_config([("test", {"data.seq_len": 16, "train.micro_batch_size": 2, "train.global_batch_size": 4,
                                     "parallel.cp_layout": "zigzag"})])
    on_gpu = build.build_loader(config, dataset, state, 0, torch.device("cuda", 0)).loader
    on_cpu = build.build_loader(config, dataset, state, 0, torch.device("cpu")).loader
    assert (on_gpu.num_workers, on_gpu.pin_memory, on_gpu.prefetch_factor) == (2, True, 2)
    assert (on_cpu.num_workers, on_cpu.pin_memory) == (0, False)
    config.data.num_workers = 1
    assert build.build_loader(config, dataset, state, 0, torch.device("cuda", 0)).loader.num_workers == 1
