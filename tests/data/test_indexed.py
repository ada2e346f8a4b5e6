"""The Megatron .bin/.idx format: exact bytes, round trips, and clear errors on bad files."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from cp_train.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    check_vocab_fits,
    data_path,
    dtype_code,
    index_path,
    partial_name,
    token_dtype_for_vocab,
)


def _documents(dtype: np.dtype, count: int = 6, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    high = 65535 if np.dtype(dtype) == np.uint16 else 2**31 - 1
    return [rng.integers(0, high, size=int(rng.integers(1, 40)), endpoint=True).astype(dtype)
            for _ in range(count)]


def _write(prefix, documents, dtype) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)


def test_megatron_dtype_codes():
    expected = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                7: "float32", 8: "uint16"}
    assert {code: np.dtype(t).name for code, t in DTYPE_CODES.items()} == expected
    assert dtype_code(np.uint16) == 8 and dtype_code(np.int32) == 4
    with pytest.raises(ValueError, match="no Megatron dtype code"):
        dtype_code(np.uint32)


def test_token_dtype_follows_vocab_size():
    assert token_dtype_for_vocab(8192) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128_000) == np.int32


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_index_bytes_follow_documented_layout(tmp_path, dtype, code):
    docs = _documents(dtype)
    prefix = tmp_path / "corpus"
    _write(prefix, docs, dtype)

    raw = index_path(prefix).read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, dcode, sequences, doc_entries = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, dcode, sequences, doc_entries) == (1, code, len(docs), len(docs) + 1)
    sizes = np.frombuffer(raw, "<i4", sequences, 34)
    pointers = np.frombuffer(raw, "<i8", sequences, 34 + 4 * sequences)
    doc_index = np.frombuffer(raw, "<i8", doc_entries, 34 + 12 * sequences)
    assert len(raw) == 34 + 12 * sequences + 8 * doc_entries
    itemsize = np.dtype(dtype).itemsize
    assert sizes.tolist() == [len(d) for d in docs]
    assert pointers.tolist() == (np.cumsum([0] + [len(d) * itemsize for d in docs[:-1]])).tolist()
    assert doc_index.tolist() == list(range(len(docs) + 1))
    assert data_path(prefix).read_bytes() == b"".join(d.astype(dtype).tobytes() for d in docs)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    docs = _documents(dtype, count=9, seed=3)
    _write(tmp_path / "c", docs, dtype)
    ds = IndexedDataset(tmp_path / "c")
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == ds.num_documents == 9
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        np.testing.assert_array_equal(ds.get(i, 1, len(doc) - 1), doc[1:])
    with pytest.raises(IndexError):
        ds.get(0, 0, len(docs[0]) + 1)
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers re-open the files
    np.testing.assert_array_equal(clone[4], docs[4])


def test_documents_of_several_sequences_load(tmp_path):
    """Megatron's sentence-split files: one document, several sequences."""
    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as writer:
        writer.add_document(np.arange(5), sequence_lengths=[2, 3])
        writer.add_document(np.arange(10, 14))
    ds = IndexedDataset(tmp_path / "s")
    assert len(ds) == 3 and ds.num_documents == 2
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds[1].tolist() == [2, 3, 4] and ds[2].tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="do not add up"):
        IndexedDatasetWriter(tmp_path / "t", np.uint16).add_document(np.arange(5), [2, 2])


def test_empty_dataset_loads(tmp_path):
    _write(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0


def test_writer_refuses_ids_outside_the_dtype(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "w", np.uint16)
    with pytest.raises(ValueError, match="int32"):
        writer.add_document(np.array([1, 70_000]))
    with pytest.raises(ValueError, match="do not fit uint16"):
        writer.add_document(np.array([-1, 5]))


def test_missing_files_are_named(tmp_path):
    _write(tmp_path / "m", _documents(np.uint16, 2), np.uint16)
    data_path(tmp_path / "m").unlink()
    with pytest.raises(FileNotFoundError, match=r"m\.bin is missing"):
        IndexedDataset(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx is missing"):
        IndexedDataset(tmp_path / "nothing")
    _write(tmp_path / "d", _documents(np.uint16, 2), np.uint16)
    with pytest.raises(FileNotFoundError, match=rf"d\.bin\.idx is missing: pass the dataset's prefix without \.bin or "
                                                rf"\.idx \({tmp_path}/d\)"):
        IndexedDataset(data_path(tmp_path / "d"))


@pytest.mark.parametrize("keep", [20, 60])  # inside the header, inside the arrays
def test_truncated_index_is_named(tmp_path, keep):
    _write(tmp_path / "t", _documents(np.uint16, 4), np.uint16)
    idx = index_path(tmp_path / "t")
    idx.write_bytes(idx.read_bytes()[:keep])
    with pytest.raises(ValueError, match=r"t\.idx is truncated"):
        IndexedDataset(tmp_path / "t")


def test_truncated_or_mismatched_data_is_named(tmp_path):
    _write(tmp_path / "t", _documents(np.uint16, 4), np.uint16)
    bin_file = data_path(tmp_path / "t")
    full = bin_file.read_bytes()
    bin_file.write_bytes(full[:-2])
    with pytest.raises(ValueError, match=r"t\.bin is truncated"):
        IndexedDataset(tmp_path / "t")
    bin_file.write_bytes(full + b"\x00\x00")
    with pytest.raises(ValueError, match="do not belong together"):
        IndexedDataset(tmp_path / "t")


def test_bad_magic_and_version(tmp_path):
    _write(tmp_path / "b", _documents(np.uint16, 2), np.uint16)
    idx = index_path(tmp_path / "b")
    raw = bytearray(idx.read_bytes())
    idx.write_bytes(b"NOTMAGIC!" + raw[9:])
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX index"):
        IndexedDataset(tmp_path / "b")
    raw[9:17] = struct.pack("<Q", 2)
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(tmp_path / "b")


def test_vocab_that_does_not_fit_the_dtype_or_the_ids(tmp_path):
    documents = _documents(np.uint16, 2)
    _write(tmp_path / "v", documents, np.uint16)
    ds = IndexedDataset(tmp_path / "v")
    largest = int(max(doc.max() for doc in documents))
    ds.check_vocab(65536)
    ds.check_vocab(largest + 1)
    with pytest.raises(ValueError, match=rf"v\.bin holds token id {largest}, outside the model's {largest} ids: it was "
                                         rf"tokenized with another tokenizer"):
        ds.check_vocab(largest)
    ds.check_vocab(largest, scan_tokens=0)  # the scan is bounded
    with pytest.raises(ValueError, match=r"100000 ids does not fit .*v\.bin.*uint16.*int32"):
        ds.check_vocab(100_000)
    check_vocab_fits(np.int32, 100_000)
    with pytest.raises(ValueError, match="not integer token ids"):
        check_vocab_fits(np.float32, 10)


def test_reads_an_index_written_byte_by_byte(tmp_path):
    """An .idx assembled by hand from the documented layout (int32 tokens, 2 docs, 3 sequences)."""
    sequences = [np.array([7, 8], "<i4"), np.array([9], "<i4"), np.array([1, 2, 3], "<i4")]
    prefix = tmp_path / "hand"
    data_path(prefix).write_bytes(b"".join(s.tobytes() for s in sequences))
    index_path(prefix).write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3)
        + np.array([2, 1, 3], "<i4").tobytes() + np.array([0, 8, 12], "<i8").tobytes()
        + np.array([0, 2, 3], "<i8").tobytes())
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(3)] == [s.tolist() for s in sequences]


def test_a_partial_file_is_hidden_beside_its_target_and_names_its_host_and_process(tmp_path) -> None:
    """Nodes sharing a file system build the same cache files at once, and containers repeat pids: each writer's
    partial file names its host and its process."""
    import os
    import socket

    partial = partial_name(tmp_path / "corpus.idx")
    assert partial.parent == tmp_path and partial.name.startswith(".corpus.idx.tmp-")
    assert partial.name.endswith(f"-{socket.gethostname()}-{os.getpid()}")

