"""Blending datasets by weight: proportions at every prefix, routing, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_train.data.blended import BlendedDataset, blend_schedule, blended_sample_counts
from cp_train.data.gpt_dataset import GPTDataset
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
