"""GPT samples: equal to the naive concatenation of shuffled documents; cache, masks, splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cp_train.data.gpt_dataset as gpt_dataset_module
from cp_train.data import sample_index
from cp_train.data.gpt_dataset import GPTDataset, cu_seqlens, split_documents, train_valid_split
from cp_train.data.indexed import IndexedDataset, IndexedDatasetWriter, index_path
from cp_train.data.sample_index import build_indices, samples_per_block

EOD, PAD = 2, 3


def make_indexed(path, num_docs: int = 23, seed: int = 0, max_len: int = 30) -> IndexedDataset:
    """Documents of random ids in [4, 5000) of random length, each ending with EOD."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.uint16) as writer:
        for _ in range(num_docs):
            body = rng.integers(4, 5000, size=int(rng.integers(1, max_len)))
            writer.add_document(np.append(body, EOD))
    return IndexedDataset(path)


@pytest.fixture()
def indexed(tmp_path) -> IndexedDataset:
    return make_indexed(tmp_path / "docs")


@pytest.mark.parametrize("chunk", [1, 5, sample_index.CHUNK_DOCUMENTS])
def test_samples_equal_naive_concatenation_of_shuffled_documents(indexed, monkeypatch, chunk):
    """Whatever the chunk of documents the sample index is found by (``CHUNK_DOCUMENTS``); int32 indices."""
    monkeypatch.setattr(sample_index, "CHUNK_DOCUMENTS", chunk)
    seq_len, num_samples = 16, 120  # several epochs of ~350 tokens
    ds = GPTDataset(indexed, seq_len, num_samples, seed=7)
    assert {np.asarray(getattr(ds.indices, name)).dtype for name in sample_index.INDEX_NAMES} == {np.dtype(np.int32)}
    order = np.asarray(ds.indices.document_index)
    docs = np.arange(len(indexed))
    epochs = len(order) // len(docs)
    assert epochs >= 2 and len(order) == epochs * len(docs)
    for e in range(epochs):  # every epoch holds every document once, in its own order
        assert sorted(order[e * len(docs):(e + 1) * len(docs)].tolist()) == docs.tolist()
    assert order[:len(docs)].tolist() != order[len(docs):2 * len(docs)].tolist()
    stream = np.concatenate([indexed[d] for d in order]).astype(np.int64)
    shuffle = np.asarray(ds.indices.shuffle_index)
    block = samples_per_block(int(indexed.sequence_lengths.sum()), seq_len)
    assert len(shuffle) == num_samples and len(set(shuffle.tolist())) == num_samples
    for start in range(0, num_samples, block):  # each epoch's worth of samples is shuffled on its own
        part = shuffle[start:start + block].tolist()
        assert all(start <= j < start + block for j in part)
        if len(part) == block:
            assert sorted(part) == list(range(start, start + block))
    assert shuffle.tolist() != list(range(num_samples))
    for i in range(num_samples):
        tokens, lengths = ds.sample_tokens(i)
        j = shuffle[i]
        assert len(tokens) == seq_len + 1 == sum(lengths)
        np.testing.assert_array_equal(tokens, stream[j * seq_len: j * seq_len + seq_len + 1])
        item = ds[i]
        assert all(v.shape == (seq_len,) for v in item.values())
        assert item["tokens"].dtype == item["labels"].dtype == torch.int64
        assert item["loss_mask"].dtype == torch.float32
        np.testing.assert_array_equal(item["tokens"].numpy(), tokens[:-1])
        np.testing.assert_array_equal(item["labels"].numpy(), tokens[1:])


def test_a_sample_starts_in_the_document_holding_its_first_token_empty_ones_skipped(monkeypatch):
    """Row j of the sample index: the document (by position in the document index) whose tokens hold token
    ``j * seq_len`` of the concatenation, and the offset there; empty documents hold no token. Chunks of 1 and 3
    documents and one chunk agree."""
    sizes = np.array([0, 5, 0, 0, 7, 1, 0, 3, 9, 0, 2], dtype=np.int32)
    documents = np.arange(len(sizes))
    found = []
    for chunk in (1, 3, 1 << 22):
        monkeypatch.setattr(sample_index, "CHUNK_DOCUMENTS", chunk)
        found.append(build_indices(sizes, documents, 4, 30, seed=3))
    for indices in found[1:]:
        assert all(np.array_equal(getattr(indices, n), getattr(found[0], n)) for n in sample_index.INDEX_NAMES)
    indices = found[0]
    ends = np.cumsum(sizes[indices.document_index])
    for j, (position, offset) in enumerate(indices.sample_index.tolist()):
        start = ends[position] - sizes[indices.document_index[position]]
        assert sizes[indices.document_index[position]] > 0 and start <= j * 4 < ends[position], (j, position)
        assert offset == j * 4 - start


def test_more_samples_continue_the_same_stream(tmp_path, indexed):
    """Training longer (more samples) must not reorder the samples a shorter run already served."""
    short = GPTDataset(indexed, 16, 40, seed=5, cache_dir=tmp_path)
    long = GPTDataset(indexed, 16, 150, seed=5, cache_dir=tmp_path)  # several more epochs
    assert not long.loaded_from_cache
    for i in range(40):
        assert short[i]["tokens"].tolist() == long[i]["tokens"].tolist(), f"sample {i} moved"
    assert len({tuple(long[i]["tokens"].tolist()) for i in range(150)}) > 140


def test_seed_changes_order_and_is_reproducible(tmp_path, indexed):
    a = GPTDataset(indexed, 8, 30, seed=1, cache_dir=tmp_path / "a")
    b = GPTDataset(indexed, 8, 30, seed=1, cache_dir=tmp_path / "b")
    c = GPTDataset(indexed, 8, 30, seed=2, cache_dir=tmp_path / "a")
    assert not b.loaded_from_cache and not c.loaded_from_cache
    assert [a[i]["tokens"].tolist() for i in range(30)] == [b[i]["tokens"].tolist() for i in range(30)]
    assert [a[i]["tokens"].tolist() for i in range(30)] != [c[i]["tokens"].tolist() for i in range(30)]


def test_cache_is_reused_not_rebuilt(indexed, monkeypatch):
    first = GPTDataset(indexed, 16, 50, seed=3)
    assert not first.loaded_from_cache
    cached = sorted(p.name for p in first.cache_dir.glob(f"{first.cache_stem}*"))
    assert cached == sorted(f"{first.cache_stem}.{suffix}" for suffix in (
        "json", "document_index.npy", "sample_index.npy", "shuffle_index.npy"))
    assert first.cache_dir.samefile(index_path(indexed.prefix).parent)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("indices rebuilt although a cache exists")

    monkeypatch.setattr(gpt_dataset_module, "build_indices", no_rebuild)
    second = GPTDataset(indexed, 16, 50, seed=3, mask_eod_loss=True, eod_id=EOD)  # masks: same key
    assert second.loaded_from_cache
    for i in range(50):
        assert torch.equal(first[i]["tokens"], second[i]["tokens"])
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(indexed, 16, 51, seed=3)  # another sample count is another cache


def test_loss_mask_positions_and_document_boundaries(indexed):
    plain = GPTDataset(indexed, 32, 40, seed=5)
    masked = GPTDataset(indexed, 32, 40, seed=5, eod_id=EOD, mask_eod_loss=True,
                        reset_position_ids=True)
    for i in range(40):
        item, reset = plain[i], masked[i]
        tokens, doc_ids = item["tokens"], item["document_ids"]
        assert torch.equal(tokens, reset["tokens"]) and torch.equal(doc_ids, reset["document_ids"])
        assert torch.all(item["loss_mask"] == 1)
        assert torch.equal(reset["loss_mask"], (tokens != EOD).float())
        assert torch.equal(item["position_ids"], torch.arange(32))
        # a new document starts exactly after each EOD (every document ends with one)
        starts = torch.cat([torch.tensor([True]), doc_ids[1:] != doc_ids[:-1]])
        after_eod = torch.cat([torch.tensor([True]), tokens[:-1] == EOD])
        assert torch.equal(starts, after_eod)
        assert doc_ids[0] == 0 and torch.all(torch.diff(doc_ids) >= 0)
        positions = reset["position_ids"]
        assert torch.equal(positions == 0, starts)
        assert torch.all(positions[1:][~starts[1:]] == positions[:-1][~starts[1:]] + 1)


def test_padding_labels_are_masked(tmp_path):
    with IndexedDatasetWriter(tmp_path / "p", np.uint16) as writer:
        writer.add_document(np.array([5, 6, PAD, PAD, EOD]))
        writer.add_document(np.array([7, 8, 9, EOD]))
    ds = GPTDataset(IndexedDataset(tmp_path / "p"), 8, 1, seed=0, pad_id=PAD)
    item = ds[0]
    assert torch.equal(item["loss_mask"], (item["labels"] != PAD).float())
    assert item["loss_mask"].sum() < 8


def test_cu_seqlens():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert cu_seqlens(ids).tolist() == [0, 2, 5, 6, 7, 12]
    assert cu_seqlens(ids[0]).tolist() == [0, 2, 5, 6]
    assert cu_seqlens(ids).dtype == torch.int32


def test_split_documents():
    train, valid, test = split_documents(100, (0.9, 0.07, 0.03))
    assert (len(train), len(valid), len(test)) == (90, 7, 3)
    assert np.concatenate([train, valid, test]).tolist() == list(range(100))
    train, valid = train_valid_split(10, 0.2)
    assert train.tolist() == list(range(8)) and valid.tolist() == [8, 9]
    assert len(train_valid_split(10, 0.0)[1]) == 0
    assert [len(s) for s in split_documents(7, (98, 2))] == [7, 0]
    with pytest.raises(ValueError):
        split_documents(10, (0.5, -0.1))
    with pytest.raises(ValueError):
        train_valid_split(10, 1.0)


def test_splits_use_only_their_documents(indexed):
    train_docs, valid_docs = train_valid_split(len(indexed), 0.25)
    train = GPTDataset(indexed, 8, 60, seed=1, documents=train_docs, name="train")
    valid = GPTDataset(indexed, 8, 10, seed=1, documents=valid_docs, name="valid")
    assert set(np.asarray(train.indices.document_index).tolist()) == set(train_docs.tolist())
    assert set(np.asarray(valid.indices.document_index).tolist()) == set(valid_docs.tolist())
    assert train.cache_stem != valid.cache_stem


def test_too_small_for_one_sample(indexed):
    with pytest.raises(ValueError, match="fewer than one sample of seq_len \\+ 1 = 10001; use a shorter"):
        GPTDataset(indexed, 10_000, 1)
    _, valid = train_valid_split(len(indexed), 0.01)
    with pytest.raises(ValueError, match="valid split .* has no documents"):
        GPTDataset(indexed, 8, 1, documents=valid, name="valid")
    with pytest.raises(ValueError, match="needs eod_id"):
        GPTDataset(indexed, 8, 1, mask_eod_loss=True)
    with pytest.raises(ValueError, match="must be >= 1"):
        GPTDataset(indexed, 8, 0)
