"""Blending datasets by weight: proportions at every prefix, routing, clear errors; ``data.prefix`` (and
``--data-path``) in Megatron-LM's blend form, trained on by the real trainer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.blend import one_sort_schedule
from cp_train.build import DataSources
from cp_train.cli.train import check_input_files
from cp_train.config.flags import parse_args
from cp_train.config.schema import ConfigError
from cp_train.data.blend_spec import parse_blend, size_weights
from cp_train.data.blended import BlendedDataset, blend_schedule, blended_sample_counts
from cp_train.data.gpt_dataset import GPTDataset
from cp_train.data.indexed import IndexedDataset
from cp_train.errors import InputError
from cp_train.eval.cli import build_parser as eval_parser
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel
from cp_train.trainer import Trainer
from tests import trainer_cases
from tests.data.test_gpt_dataset import make_indexed


@pytest.mark.parametrize("weights", [(3, 1), (0.5, 0.5), (0.7, 0.2, 0.1), (5, 1, 1, 1, 1, 0.1)])
def test_every_prefix_is_close_to_the_weights(weights):
    num_samples = 997
    dataset_ids, sample_ids = blend_schedule(weights, num_samples)
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.cumsum(np.eye(len(weights))[dataset_ids], axis=0)
    prefix = np.arange(1, num_samples + 1)[:, None]
    assert np.abs(counts - share * prefix).max() <= (len(weights) - 1) / 2 + 1e-9
    for d in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert sample_ids[dataset_ids == d].tolist() == list(range(int(counts[-1, d])))
    assert blended_sample_counts(weights, num_samples) == counts[-1].astype(int).tolist()


def test_samples_are_served_in_order_of_their_ideal_time_ties_to_the_lower_dataset():
    """The order is that of the times ``(k + 0.5) / w_d``, a tie taking the lower dataset first (equal weights
    alternate 0, 1, 2, ...); the same order as a sort on (time, dataset) of every dataset's samples."""
    assert blend_schedule((1, 1, 1), 7)[0].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert blend_schedule((2, 1), 6)[0].tolist() == [0, 1, 0, 0, 1, 0]  # times 0.75, 1.5, 2.25, 3.75, 4.5, ...
    weights = np.random.default_rng(0).random(7) + 0.01
    dataset_ids, sample_ids = blend_schedule(weights, 5000)
    share = weights / weights.sum()
    times = (sample_ids + 0.5) / share[dataset_ids]
    assert np.all((np.diff(times) > 0) | ((np.diff(times) == 0) & (np.diff(dataset_ids) > 0)))


class _Sized(torch.utils.data.Dataset):
    """A dataset of ``count`` samples (of 8 tokens) that are never read."""

    def __init__(self, count: int) -> None:
        self.count, self.seq_len = count, 8

    def __len__(self) -> int:
        return self.count


def test_a_blends_schedule_is_made_once_and_read_memory_mapped(tmp_path, monkeypatch):
    """``cached_blend_schedule``: the first call makes and saves it (compact dtypes), later ones read the files
    memory-mapped without making it; other weights or sample counts make their own."""
    from cp_train.data import blended

    weights, samples = (0.7, 0.2, 0.1), 1001
    made = blended.cached_blend_schedule(weights, samples, tmp_path, "train")
    expected = blend_schedule(weights, samples)
    assert all(np.array_equal(a, b) for a, b in zip(made, expected, strict=True))
    assert [a.dtype for a in made] == [np.int16, np.int32] and all(isinstance(a, np.memmap) for a in made)
    assert len(list(tmp_path.glob("blend.train.*.npy"))) == 2

    def refuse(*args):
        raise AssertionError("made again")

    monkeypatch.setattr(blended, "_fill_schedule", refuse)
    again = blended.cached_blend_schedule(weights, samples, tmp_path, "train")
    assert all(np.array_equal(a, b) for a, b in zip(again, expected, strict=True))
    with pytest.raises(AssertionError, match="made again"):
        blended.cached_blend_schedule(weights, samples + 1, tmp_path, "train")
    counts = blended_sample_counts(weights, samples, again)
    dataset = BlendedDataset([_Sized(c) for c in counts], weights, samples, again)
    assert dataset.dataset_ids is again[0]


@pytest.mark.parametrize("window", [7, 100, 1 << 20])
def test_the_schedule_made_window_by_window_is_one_sort_of_every_sample(window, monkeypatch, tmp_path):
    """Windows of ideal time sorted apart give the order of one sort of every sample (ties across a window's end
    included: equal weights tie at every step), cached or not, with a window's memory at work."""
    from cp_train.data import blended

    monkeypatch.setattr(blended, "WINDOW_SAMPLES", window)
    rng = np.random.default_rng(0)
    for weights in [(1, 1, 1), (2, 1), (1, 0, 1), (1e-4, 1, 1), tuple(rng.random(30) + 1e-3), (4, 2, 2, 1)]:
        for samples in (1, 997, 2500):
            expected = one_sort_schedule(weights, samples)
            made = blend_schedule(weights, samples)
            cached = blended.cached_blend_schedule(weights, samples, tmp_path, "train")
            for got in (made, cached):
                assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), (weights, samples)
            counts = np.bincount(expected[0], minlength=len(weights)).tolist()
            assert blended.blended_sample_counts(weights, samples, cached) == counts  # counted window by window


def test_zero_weight_is_never_drawn():
    dataset_ids, _ = blend_schedule((1, 0, 1), 50)
    assert 1 not in dataset_ids.tolist()
    with pytest.raises(ValueError, match="positive sum"):
        blend_schedule((0, 0), 5)


def test_blended_dataset_routes_to_the_datasets(tmp_path):
    first = GPTDataset(make_indexed(tmp_path / "a", seed=1), 8, 40, seed=1)
    second = GPTDataset(make_indexed(tmp_path / "b", seed=2), 8, 20, seed=1)
    blend = BlendedDataset([first, second], (2, 1), 45)
    assert len(blend) == 45 and blend.seq_len == 8
    seen = {0: 0, 1: 0}
    for i in range(45):
        d = int(blend.dataset_ids[i])
        expected = (first, second)[d][seen[d]]
        seen[d] += 1
        assert torch.equal(blend[i]["tokens"], expected["tokens"])
    assert seen == {0: 30, 1: 15}


def test_blend_errors(tmp_path):
    small = GPTDataset(make_indexed(tmp_path / "a"), 8, 5, seed=1)
    other_len = GPTDataset(make_indexed(tmp_path / "b"), 4, 50, seed=1)
    with pytest.raises(ValueError, match="needs 10; build it with num_samples >= 10"):
        BlendedDataset([small, small], (1, 1), 20)
    with pytest.raises(ValueError, match="different seq_len"):
        BlendedDataset([small, other_len], (1, 1), 4)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendedDataset([small, small], (1,), 4)


def test_data_prefix_takes_megatrons_blend_form(tmp_path):
    assert parse_blend("data/web") == ((1.0, "data/web"),)
    assert parse_blend(" 0.7 data/web  0.3 data/code ") == ((0.7, "data/web"), (0.3, "data/code"))
    assert parse_blend("data/web data/code") == ((None, "data/web"), (None, "data/code"))  # weighed by tokens
    assert size_weights(parse_blend("a b"), [300, 100]) == [300.0, 100.0]
    assert size_weights(parse_blend("2 a 1 b"), [300, 100]) == [2.0, 1.0]
    make_indexed(tmp_path / "my data")  # one dataset whose path holds a space is still one dataset
    assert parse_blend(str(tmp_path / "my data")) == ((1.0, str(tmp_path / "my data")),)
    for bad in ("", "0.7 a b", "a 0.3 b", "0 a 1 b", "-1 a 2 b", "x a 1 b", "inf a 1 b"):
        with pytest.raises(ValueError, match="is 'WEIGHT PREFIX WEIGHT PREFIX ...' with positive weights"):
            parse_blend(bad)


def test_data_path_flag_reads_a_blend_and_each_prefix_is_checked(tmp_path):
    make_indexed(tmp_path / "web")
    web, code = str(tmp_path / "web"), str(tmp_path / "code")
    config, _ = parse_args(["--data-path", "0.7", web, "0.3", code, "--train-steps", "3"])
    assert config.data.prefix == f"0.7 {web} 0.3 {code}" and config.train.steps == 3
    with pytest.raises(InputError, match=f"^data.prefix {code}: {code}.idx is missing"):
        check_input_files(config)  # the second dataset of the blend
    config.data.prefix = f"0.7 {web} {code}"
    with pytest.raises(ConfigError, match="blend of datasets is 'WEIGHT PREFIX"):
        check_input_files(config)
    config, _ = parse_args(["--train-data-path", web, web, "--valid-data-path", "1", web, "3", code])  # Megatron's
    assert (config.data.prefix, config.data.valid_prefix) == (f"{web} {web}", f"1 {web} 3 {code}")
    with pytest.raises(InputError, match=f"^data.valid_prefix {code}: {code}.idx is missing"):
        check_input_files(config)
    evaluation = eval_parser().parse_args(["--load", "x", "--data-path", "2", web, "1", web, "--valid-data-path", web])
    assert (getattr(evaluation, "data.prefix"), getattr(evaluation, "data.valid_prefix")) == (f"2 {web} 1 {web}", web)
    with pytest.raises(ConfigError, match="no test split: evaluate a checkpoint on that data with cp-train-eval "
                                          f"--load CHECKPOINT --valid-data-path {code} \\(see"):
        parse_args(["--test-data-path", code])


def train_on_blend(state: ParallelState, spec: str, run_dir: str, **overrides: object) -> dict:
    """Rank side: two steps of the tiny run on the blend ``spec``, with a validation at step 2."""
    config = trainer_cases.tiny_config(spec, run_dir, state.dims, **{"train.steps": 2, "train.valid_interval": 2,
                                                                     "train.valid_iters": 2, **overrides})
    trainer = Trainer(config, state)
    result = trainer.train()
    train, valid = trainer.train_data, trainer.valid_data
    parts = lambda data: getattr(data, "datasets", [data])  # noqa: E731 - a blend's datasets, or the one
    return {"types": [type(train).__name__, type(valid).__name__],
            "parts": [(part.indexed.prefix, part.name) for data in (train, valid) for part in parts(data)],
            "documents": [np.unique(part.indices.document_index).size for data in (train, valid)
                          for part in parts(data)],
            "train_ids": train.dataset_ids.tolist(), "valid_ids": getattr(valid, "dataset_ids", np.zeros(0)).tolist(),
            "mapped": isinstance(train.dataset_ids, np.memmap), "losses": result.losses,
            "eval_losses": result.eval_losses}


def test_the_trainer_trains_on_a_blend(spawn_world, tmp_path):
    """``data.prefix: 3 A 1 B``: the train and validation samples come from both datasets 3 to 1, each split into
    train and validation documents as one dataset would be."""
    first = trainer_cases.write_corpus(tmp_path / "first", seed=1)
    second = trainer_cases.write_corpus(tmp_path / "second", num_docs=300, seed=2)
    got = spawn_world(1).run(run_with_parallel, (1, 1, 1), train_on_blend, f"3 {first} 1 {second}",
                             str(tmp_path / "run"))[0]
    assert got["types"] == ["BlendedDataset", "BlendedDataset"]
    assert got["parts"] == [(first, "train"), (second, "train"), (first, "valid"), (second, "valid")]
    assert got["train_ids"] == [0, 0, 1, 0, 0, 0, 1, 0]  # 2 steps x 4 samples, 3 to 1 at every prefix
    assert got["mapped"] and len(list((tmp_path / "run" / "index-cache").glob("blend.*.npy"))) == 4  # train, valid
    assert got["valid_ids"] == [0, 0, 1, 0, 0, 0, 1, 0]  # 2 evaluation batches of 4
    assert got["documents"] == [540, 270, 60, 30]  # data.valid_fraction 0.1 of each held out
    assert sorted(got["losses"]) == [1, 2] and all(np.isfinite(v) for v in got["losses"].values())
    assert list(got["eval_losses"]) == [2] and np.isfinite(got["eval_losses"][2])


def test_validation_data_of_its_own_and_a_blend_weighed_by_tokens(spawn_world, tmp_path):
    """``data.prefix: A B`` (no weights: by tokens, as Megatron-LM) and ``data.valid_prefix: C``: every document of
    A and B trains, 2 to 1 as their tokens, and validation reads C whole (also for the long-context eval)."""
    first = trainer_cases.write_corpus(tmp_path / "first", seed=1)
    second = trainer_cases.write_corpus(tmp_path / "second", num_docs=300, seed=2)
    held_out = trainer_cases.write_corpus(tmp_path / "held-out", num_docs=50, seed=3)
    tokens = [IndexedDataset(prefix).num_tokens for prefix in (first, second)]
    assert 1.8 < tokens[0] / tokens[1] < 2.2
    got = spawn_world(1).run(run_with_parallel, (1, 1, 1), train_on_blend, f"{first} {second}", str(tmp_path / "run"),
                             **{"data.valid_prefix": held_out})[0]
    assert got["types"] == ["BlendedDataset", "GPTDataset"]
    assert got["parts"] == [(first, "train"), (second, "train"), (held_out, "valid")]
    assert got["documents"] == [600, 300, 50]  # nothing held out of A and B; C whole
    assert got["train_ids"] == blend_schedule(tokens, 8)[0].tolist() and got["train_ids"].count(1) in (2, 3)
    assert list(got["eval_losses"]) == [2] and np.isfinite(got["eval_losses"][2])
    sources = DataSources(f"{first} {second}", None, 0, None, 64, valid_prefix=f"1 {held_out} 1 {second}")
    assert sources.eval_prefix == held_out


def test_a_run_on_a_blend_resumes_bitwise(spawn_world, tmp_path):
    """Stopped after step 2 and rerun, a run on a blend continues the same stream of samples: step 3's inputs
    and loss equal the uninterrupted run's, bitwise."""
    first = trainer_cases.write_corpus(tmp_path / "first", seed=1)
    second = trainer_cases.write_corpus(tmp_path / "second", num_docs=300, seed=2)
    spec, world = f"2 {first} 1 {second}", spawn_world(1)

    def run(name: str, until_step: int | None = None) -> dict:
        overrides = {"train.steps": 3, "train.valid_interval": 0, "checkpoint.save": str(tmp_path / f"{name}-ckpt"),
                     "checkpoint.interval": 1}
        return world.run(run_with_parallel, (1, 1, 1), trainer_cases.train_layout, spec, str(tmp_path / name),
                         overrides, until_step)[0]

    whole, _, resumed = run("whole"), run("stopped", until_step=2), run("stopped")
    assert resumed["step_at_start"] == 2 and sorted(resumed["losses"]) == [3]
    assert resumed["batches"][3] == whole["batches"][3] and resumed["losses"][3] == whole["losses"][3]
    assert whole["batches"][3] != whole["batches"][2]
