"""Attention-work imbalance across CP ranks on real packed documents (the default corpus).

    python -m bench.balance --seqlens 8192 --worlds 2 4 8

Samples are packed from the embedded corpus (the Python standard library, tokenized) as the trainer
packs them. A token's work is the number of keys it sees under the per-document causal mask; a rank's
work is the sum over its tokens, per global batch of ``--batch`` samples. ``imbalance`` is the
heaviest rank's work over the mean (1.0 is perfect): the ring's steps wait for the heaviest rank.
Prints the mean and worst imbalance over ``--batches`` batches per (seqlen, cp, layout).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.common import emit
from cp_train.data.default_corpus import prepare_default_corpus
from cp_train.data.gpt_dataset import GPTDataset
from cp_train.data.indexed import IndexedDataset
from cp_train.parallel.cp.balanced_layout import balanced_positions, token_work
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, sequence_positions


def rank_work(document_ids: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """``[world]`` summed work of each rank's tokens of one sample."""
    work = token_work(document_ids)
    seq = document_ids.shape[-1]
    if layout in STATIC_LAYOUTS:
        positions = torch.stack([sequence_positions(seq, r, world, layout) for r in range(world)])
    else:
        positions = balanced_positions(document_ids, world)
    return work[positions].sum(1)


def measure(dataset: GPTDataset, world: int, layout: str, batch: int, batches: int) -> list[float]:
    ratios = []
    for index in range(batches):
        total = sum(rank_work(dataset[index * batch + i]["document_ids"], world, layout)
                    for i in range(batch))
        ratios.append(float(total.max() / total.double().mean()))
    return ratios


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--layouts", nargs="+", default=[*STATIC_LAYOUTS, "balanced"])
    parser.add_argument("--batch", type=int, default=1, help="samples per global batch")
    parser.add_argument("--batches", type=int, default=64)
    args = parser.parse_args(argv)
    corpus = prepare_default_corpus()
    indexed = IndexedDataset(corpus.data_prefix)
    records = []
    for seqlen in args.seqlens:
        dataset = GPTDataset(indexed, seqlen, args.batch * args.batches, seed=1234, eod_id=0, mask_eod_loss=False)
        lengths = np.diff(np.flatnonzero(np.diff(np.concatenate(
            [dataset[i]["document_ids"].numpy() for i in range(args.batches)])) != 0))
        for world in args.worlds:
            for layout in args.layouts:
                ratios = measure(dataset, world, layout, args.batch, args.batches)
                records.append({"seqlen": seqlen, "cp": world, "layout": layout, "batch": args.batch,
                                "mean_doc_len": float(lengths.mean()) if len(lengths) else float(seqlen),
                                "imbalance_mean": float(np.mean(ratios)), "imbalance_max": float(np.max(ratios))})
    num = lambda digits: (lambda x: f"{x:.{digits}f}")  # noqa: E731
    emit(records, [("seqlen", "seqlen", str), ("cp", "cp", str), ("layout", "layout", str), ("batch", "batch", str),
                   ("mean_doc_len", "mean doc len", num(0)), ("imbalance_mean", "imbalance (mean)", num(3)),
                   ("imbalance_max", "imbalance (max)", num(3))])
    return records


if __name__ == "__main__":
    main()
