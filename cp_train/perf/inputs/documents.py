"""Packed documents for the planner: samples cut from document lengths, and each CP rank's plan of one.

The trainer packs documents end to end into samples of ``seq_len`` tokens (``data/gpt_dataset.py``); with
``data.document_mask`` attention stays inside each. From the documents' lengths (the run's own, or
``--document-lengths``; a list shorter than the sample repeats) the planner cuts samples as the loader does and
plans each rank's tokens with ``plan_from_gathered`` in the layout, the very plan the trainer's loader builds.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from cp_train.data.loader import rank_positions
from cp_train.errors import InputError
from cp_train.parallel.cp.algorithms.registry import CPAlgorithm
from cp_train.parallel.cp.plan.batch_plan import CPPlan, plan_from_gathered


class DocumentError(InputError):
    """A ``--document-lengths`` that cannot be read."""


def parse_document_lengths(spec: str) -> tuple[int, ...]:
    """Lengths from ``spec``: one integer (every document that long), a comma list, a file of integers (one or
    more per line), or an indexed dataset's prefix (``PREFIX.idx``: its documents' lengths in a fixed shuffled
    order, as the GPT dataset draws them)."""
    text = spec
    if not spec.replace(",", "").strip().isdigit():
        if Path(spec + ".idx").is_file():
            return _dataset_lengths(spec)
        path = Path(spec)
        if not path.is_file():
            raise DocumentError(f"--document-lengths {spec}: not a length, a comma list of lengths, a file of "
                                f"lengths, or an indexed dataset's prefix (PREFIX.idx)")
        text = path.read_text(encoding="utf-8")
    try:
        lengths = tuple(int(item) for item in text.replace(",", " ").split())
    except ValueError:
        raise DocumentError(f"--document-lengths {spec}: every entry must be a whole number of tokens") from None
    if not lengths or min(lengths) < 1:
        raise DocumentError(f"--document-lengths {spec}: give one or more lengths >= 1")
    return lengths


def _dataset_lengths(prefix: str, seed: int = 1234) -> tuple[int, ...]:
    from cp_train.data.indexed import IndexedDataset

    lengths = torch.tensor(IndexedDataset(prefix).sequence_lengths.tolist(), dtype=torch.int64)
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))
    return tuple(int(n) for n in lengths[order] if n > 0) or (1,)


def packed_document_ids(lengths: tuple[int, ...], seq_len: int) -> torch.Tensor:
    """``[1, seq_len]`` int64 document ids of one sample packed from ``lengths`` (see the module docstring)."""
    ids = torch.empty(seq_len, dtype=torch.int64)
    start, doc = 0, 0
    while start < seq_len:
        length = min(lengths[doc % len(lengths)], seq_len - start)
        ids[start:start + length] = doc
        start, doc = start + length, doc + 1
    return ids.unsqueeze(0)


def document_pieces(lengths: tuple[int, ...], seq_len: int) -> list[int]:
    """The documents' token counts inside the one sample ``packed_document_ids`` builds."""
    return torch.bincount(packed_document_ids(lengths, seq_len)[0]).tolist()


def consecutive_samples(lengths: tuple[int, ...], seq_len: int, count: int) -> list[tuple[int, ...]]:
    """The document pieces of the first ``count`` samples cut from ``lengths`` end to end (the list repeating as
    often as needed), as the loader packs them: a document cut at a sample's end continues the next."""
    samples, left, index = [], 0, 0
    for _ in range(count):
        pieces, room = [], seq_len
        while room:
            if not left:
                left, index = lengths[index % len(lengths)], index + 1
            take = min(left, room)
            pieces.append(take)
            left, room = left - take, room - take
        samples.append(tuple(pieces))
    return samples


def rank_plans(algorithm: CPAlgorithm, layout: str, cp: int, ulysses: int, lengths: tuple[int, ...], seq_len: int
               ) -> list[CPPlan]:
    """Every CP rank's plan of the sample packed from ``lengths`` (rank order)."""
    docs = packed_document_ids(lengths, seq_len)
    index = rank_positions(docs, cp, layout)  # [cp, 1, seq_len // cp], as the loader slices
    every_docs = torch.gather(docs.expand(cp, 1, seq_len), 2, index)
    return [plan_from_gathered(algorithm, cp, rank, ulysses, True, every_docs, index) for rank in range(cp)]


@lru_cache(maxsize=64)
def search_rank_plans(algorithm: CPAlgorithm, layout: str, cp: int, ulysses: int, lengths: tuple[int, ...],
                      seq_len: int) -> tuple[CPPlan, ...]:
    """``rank_plans``, kept for a search: it asks for the same plans under every TP, DP, sharding and checkpointing
    choice, which leave them alone (a few dozen algorithm, layout and cp pairs per search)."""
    return tuple(rank_plans(algorithm, layout, cp, ulysses, lengths, seq_len))
