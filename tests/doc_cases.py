"""Rank-side runner of the docs' Python snippets (``tests/structure/test_doc_blocks.py``), inside a spawned gloo world.

A snippet runs verbatim with ``exec`` in a namespace its page names with ``<!-- run with: PRELUDE -->``: the inputs
a fragment takes from the reader's code (``PRELUDES``), on 2 CP ranks in the zigzag layout, in a scratch directory
(its files, ``out/`` say, land there). A parallel state the snippet initialises is destroyed afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cp_train.parallel.cp.layout import sequence_positions
from cp_train.parallel.mesh.state import destroy_parallel

SEQ, HEADS, KV_HEADS, DIM, VOCAB = 64, 4, 2, 16, 8192


def _layout_ids() -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, positions) of this rank's half of one 64-token document, zigzag over the world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    positions = torch.as_tensor(sequence_positions(SEQ, rank, world, "zigzag"), dtype=torch.long)[None]
    return torch.zeros_like(positions), positions


def attention_inputs(workdir: Path) -> dict[str, Any]:
    """q, k, v ([1, local, heads, dim], GQA), the CP group (the world), documents, positions, ``n`` and sinks."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    n = SEQ // dist.get_world_size()
    q = torch.randn(1, n, HEADS, DIM, generator=generator)
    k, v = (torch.randn(1, n, KV_HEADS, DIM, generator=generator) for _ in range(2))
    docs, pos = _layout_ids()
    return {"q": q, "k": k, "v": v, "cp_group": dist.group.WORLD, "docs": docs, "pos": pos, "n": n,
            "model_sinks": torch.zeros(HEADS)}


def model_batch(workdir: Path) -> dict[str, Any]:
    """tokens, labels, position_ids and document_ids of one sample, this rank's slice in the zigzag layout."""
    generator = torch.Generator().manual_seed(0)
    document_ids, position_ids = _layout_ids()
    tokens, labels = (torch.randint(0, VOCAB, position_ids.shape, generator=generator) for _ in range(2))
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}


def hf_llama(workdir: Path) -> dict[str, Any]:
    """A small random Hugging Face Llama in ``workdir/Llama-3.2-1B`` (written by rank 0)."""
    if dist.get_rank() == 0:
        from tests.hf_cases import make_hf_llama

        make_hf_llama(workdir / "Llama-3.2-1B")
    dist.barrier()
    return {}


PRELUDES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "attention_inputs": attention_inputs, "model_batch": model_batch, "hf_llama": hf_llama, "nothing": lambda _: {}}


def run_snippet(source: str, prelude: str, workdir: str) -> list[str]:
    """Run ``source`` in ``PRELUDES[prelude]``'s namespace with ``workdir`` as the current directory; returns the
    names it defined."""
    directory = Path(workdir)
    namespace = {"__name__": "__doc_snippet__", **PRELUDES[prelude](directory)}
    given = set(namespace)
    previous = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(source, f"<snippet with {prelude}>", "exec"), namespace)  # noqa: S102 - the docs' own code
    finally:
        os.chdir(previous)
        destroy_parallel()
        dist.barrier()
    return sorted(set(namespace) - given - {"__builtins__"})
