"""What one teacher-forced CP forward scores, reduced exactly over the process groups.

A ``Forward`` takes this rank's slice (``LocalBatch``, in the CP layout) and returns this rank's vocab shard
of the logits ``[B, n, vocab/tp]`` (no labels) or the per-token losses ``[B, n]`` (labels given): the
``GPTModel``'s contract, or any module that attends through ``context_parallel_attention`` (the tests'
hand-wired one). Everything here is global-sequence in, exact sums out:

- ``answer_scores``: per sample, whether every answer token is the argmax of its prediction (the label's
  logit equals the maximum over the whole vocabulary, TP shards included) and the answer's summed
  log-probability; per-sample sums over the CP group.
- ``position_sums``: loss sums and token counts per log2 bucket of the position within the document
  (bucket ``b`` holds context sizes ``2**b .. 2**(b+1) - 1``), local to this rank; the caller sums them over
  DP x CP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_train.parallel.cp.balanced_layout import balanced_positions
from cp_train.parallel.cp.layout import sequence_positions


@dataclass(frozen=True)
class EvalGroups:
    """The groups one evaluation reduces over (None: a group of one) and the CP ``layout`` of the slices
    (the model's attention layout: contiguous without CP)."""

    layout: str = "contiguous"
    cp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None

    @staticmethod
    def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
        if group is None:
            return 1, 0
        return dist.get_world_size(group), dist.get_rank(group)

    @property
    def cp_size(self) -> int:
        return self._size_rank(self.cp)[0]

    @property
    def cp_rank(self) -> int:
        return self._size_rank(self.cp)[1]

    @property
    def dp_size(self) -> int:
        return self._size_rank(self.dp)[0]

    @property
    def dp_rank(self) -> int:
        return self._size_rank(self.dp)[1]

    def reduce(self, x: torch.Tensor, *names: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """``x`` all-reduced in place over the groups ``names`` (of cp, dp, tp) that exist; returns it."""
        for name in names:
            group = getattr(self, name)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(x, op=op, group=group)
        return x


@dataclass(frozen=True)
class LocalBatch:
    """This rank's slice of a batch: tokens, global positions, document ids (None: one document per sample)
    and labels (None: the forward returns logits)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None


Forward = Callable[[LocalBatch], torch.Tensor]


def local_index(document_ids: torch.Tensor, groups: EvalGroups) -> torch.Tensor:
    """``[B, L / cp]``: the global positions this CP rank holds of each sample (``document_ids [B, L]`` place
    the balanced layout's tokens; the other layouts ignore them)."""
    batch, length = document_ids.shape
    if groups.cp_size == 1:
        return torch.arange(length).expand(batch, length)
    if groups.layout == "balanced":
        return torch.stack([balanced_positions(row, groups.cp_size)[groups.cp_rank] for row in document_ids])
    return sequence_positions(length, groups.cp_rank, groups.cp_size, groups.layout).expand(batch, -1)


def vocab_logprob(logits: torch.Tensor, labels: torch.Tensor, groups: EvalGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(label), label is an argmax)`` of rows ``logits [R, vocab/tp]`` (this TP rank's shard), float64."""
    logits = logits.double()
    width = logits.shape[-1]
    low = (dist.get_rank(groups.tp) if groups.tp is not None else 0) * width
    top = groups.reduce(logits.max(-1).values, "tp", op=dist.ReduceOp.MAX)
    total = groups.reduce((logits - top[:, None]).exp().sum(-1), "tp")
    inside = (labels >= low) & (labels < low + width)
    mine = logits.gather(-1, (labels - low).clamp(0, width - 1)[:, None])[:, 0]
    label_logit = groups.reduce(torch.where(inside, mine, torch.zeros_like(mine)), "tp")
    return label_logit - top - total.log(), label_logit >= top


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 1, index.to(x.device))


@torch.no_grad()
def answer_scores(forward: Forward, tokens: torch.Tensor, spans: list[tuple[int, int]], groups: EvalGroups,
                  device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact [B] bool, answer log-probability [B] float64)`` of the global ``tokens [B, L]`` whose answers
    are ``spans`` (``[start, end)``, start >= 1, end <= L): the prediction at position ``t`` is scored against
    token ``t + 1``. Identical on every rank of the CP (and TP) group."""
    batch, length = tokens.shape
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    scored = torch.zeros(batch, length, dtype=torch.bool)
    for row, (start, end) in enumerate(spans):
        if not 1 <= start < end <= length:
            raise ValueError(f"answer span {(start, end)} is outside 1..{length}")
        scored[row, start - 1:end - 1] = True
    documents = torch.zeros_like(tokens)
    index = local_index(documents, groups)
    local = LocalBatch(_gather(tokens, index).to(device), index.to(device),
                       _gather(documents, index).to(device) if groups.layout == "balanced" else None)
    logits = forward(local)
    rows = _gather(scored, index).nonzero(as_tuple=True)
    logprob, best = vocab_logprob(logits[rows[0].to(logits.device), rows[1].to(logits.device)],
                                  _gather(labels, index)[rows].to(logits.device), groups)
    sums = torch.zeros(batch, 3, dtype=torch.float64, device=logits.device)
    sums.index_add_(0, rows[0].to(logits.device), torch.stack([torch.ones_like(logprob), best.double(), logprob], 1))
    groups.reduce(sums, "cp")
    return (sums[:, 1] == sums[:, 0]).cpu(), sums[:, 2].cpu()


def context_sizes(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: each token's position within its document, counted from 1 (the context its prediction has)."""
    batch, length = document_ids.shape
    steps = torch.arange(length).expand(batch, length)
    starts = torch.zeros_like(document_ids)
    starts[:, 1:] = torch.where(document_ids[:, 1:] != document_ids[:, :-1], steps[:, 1:], 0)
    return steps - starts.cummax(dim=1).values + 1


def bucket_count(length: int) -> int:
    """Log2 buckets up to ``length``: 1, 2-3, 4-7, ...; the last one ends at ``length``."""
    return length.bit_length()


@torch.no_grad()
def position_sums(forward: Forward, batch: dict[str, torch.Tensor], groups: EvalGroups, document_mask: bool,
                  device: torch.device | None = None) -> torch.Tensor:
    """``[2, buckets]`` float64: this rank's loss sum and token count per bucket of the context size, for the
    global ``batch`` (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``document_ids``, all ``[B, L]``)."""
    documents = batch["document_ids"]
    index = local_index(documents, groups)
    length = documents.shape[1]
    use_documents = document_mask or groups.layout == "balanced"
    local = LocalBatch(_gather(batch["tokens"], index).to(device), _gather(batch["position_ids"], index).to(device),
                       _gather(documents, index).to(device) if use_documents else None,
                       _gather(batch["labels"], index).to(device))
    losses = forward(local).double()
    weights = _gather(batch["loss_mask"], index).to(losses.device).double()
    buckets = torch.floor(torch.log2(_gather(context_sizes(documents), index).double())).long().to(losses.device)
    count = bucket_count(length)
    return torch.stack([torch.bincount(buckets.flatten(), (losses * weights).flatten(), minlength=count),
                        torch.bincount(buckets.flatten(), weights.flatten(), minlength=count)])
