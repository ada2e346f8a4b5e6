"""An ``EvalContext`` from a run's parts: its model on the current parallel state, tokenizer and data.

Shared by ``cp-train-eval`` and the periodic evaluation inside training. The held-out data is the
validation split of the run's indexed dataset (``data.valid_fraction``; every document when it is empty, as where
``data.valid_prefix`` names the validation data),
or ``haystack`` (another indexed dataset's prefix) for the needle's haystack.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from cp_train.config.schema import Config
from cp_train.data.gpt_dataset import GPTDataset, train_valid_split
from cp_train.data.indexed import IndexedDataset
from cp_train.data.tokenizers.load import load_tokenizer
from cp_train.errors import InputError, agree
from cp_train.eval.prompts import Haystack, TextTokenizer
from cp_train.eval.scoring import EvalGroups, Forward, LocalBatch
from cp_train.eval.tasks import EvalContext
from cp_train.model.gpt import GPTModel
from cp_train.parallel.mesh.state import ParallelState

HAYSTACK_TOKENS = 1 << 22  # at most this many held-out tokens are read for the haystack


def gpt_forward(model: GPTModel) -> Forward:
    """The model's forward on a ``LocalBatch`` (logits without labels, per-token losses with them)."""
    def forward(batch: LocalBatch) -> torch.Tensor:
        return model(batch.tokens, batch.position_ids, labels=batch.labels, document_ids=batch.document_ids)
    return forward


def groups_of(state: ParallelState, model: GPTModel) -> EvalGroups:
    """The state's CP, DP and TP groups, with the model's attention layout."""
    return EvalGroups(model.parallel.attention_layout, state.cp.group, state.dp.group, state.tp.group)


def _first_on_each_node(state: ParallelState, work: Callable[[], Any]) -> Any:
    """``work()`` on local rank 0 first (it may write caches), then on the others."""
    local_rank = int(os.environ.get("LOCAL_RANK", state.rank))
    result = agree(work if local_rank == 0 else lambda: None)
    return result if local_rank == 0 else work()


def _held_out(indexed: IndexedDataset, valid_fraction: float) -> np.ndarray:
    valid = train_valid_split(indexed.num_documents, valid_fraction)[1] if valid_fraction > 0 else np.arange(0)
    return valid if valid.size else np.arange(indexed.num_documents)


def _open(prefix: str, what: str) -> IndexedDataset:
    try:
        return IndexedDataset(prefix)
    except (OSError, ValueError) as error:
        raise InputError(f"{what} {prefix} cannot be read as an indexed dataset ({error})") from None


def haystack_loader(prefix: str, tokenizer: TextTokenizer, valid_fraction: float) -> Callable[[], Haystack]:
    """A maker of the haystack: the held-out documents of indexed dataset ``prefix``, concatenated."""
    def make() -> Haystack:
        indexed = _open(prefix, "the haystack")
        parts, total = [], 0
        for doc in _held_out(indexed, valid_fraction):
            parts.append(np.asarray(indexed.get(int(doc)), dtype=np.int64))
            total += parts[-1].size
            if total >= HAYSTACK_TOKENS:
                break
        return Haystack(np.concatenate(parts) if parts else np.zeros(0, np.int64), tokenizer)
    return make


def loss_batch_loader(config: Config, prefix: str, eod_id: int, pad_id: int | None, state: ParallelState
                      ) -> Callable[[int, int], Iterator[tuple[dict[str, torch.Tensor], float]]]:
    """``(length, count)`` -> this DP rank's share of ``count`` held-out samples of ``length`` tokens, each
    ``[1, length]`` with a weight (0 for the padding that gives every DP rank as many)."""
    data = config.data

    def batches(length: int, count: int) -> Iterator[tuple[dict[str, torch.Tensor], float]]:
        indexed = _open(prefix, "data.prefix")
        held_out = _held_out(indexed, data.held_out_fraction)
        make = lambda: GPTDataset(indexed, length, count, seed=data.seed, documents=held_out,
                                  eod_id=eod_id, pad_id=pad_id, mask_eod_loss=data.mask_eod_loss,
                                  reset_position_ids=data.reset_position_ids, cache_dir=data.cache_dir,
                                  name=f"longeval{length}")
        dataset = _first_on_each_node(state, make)
        dp, rank = state.dp.size, state.dp.rank
        for i in range(-(-count // dp)):
            index = rank + i * dp
            sample = dataset[min(index, count - 1)]
            yield {k: v.unsqueeze(0) for k, v in sample.items()}, float(index < count)
    return batches


def build_context(config: Config, state: ParallelState, model: GPTModel, prefix: str | None, tokenizer_path: str | None,
                  eod_id: int, pad_id: int | None, device: torch.device, autocast_dtype: torch.dtype | None,
                  haystack: str | None = None) -> EvalContext:
    """The ``EvalContext`` of ``model`` with the run's data (``prefix``, tokenizer, EOD/pad ids)."""
    if tokenizer_path is None:
        raise InputError("the evaluation needs the run's tokenizer: pass --tokenizer-model (data.tokenizer)")
    tokenizer = load_tokenizer(tokenizer_path)
    stack, held_out = haystack or prefix, config.data.held_out_fraction
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if autocast_dtype is not None:
        autocast = lambda: torch.autocast(device.type, dtype=autocast_dtype)
    return EvalContext(
        forward=gpt_forward(model), groups=groups_of(state, model), tokenizer=tokenizer,
        haystack=haystack_loader(stack, tokenizer, 0.0 if haystack else held_out) if stack else None,
        loss_batches=loss_batch_loader(config, prefix, eod_id, pad_id, state) if prefix else None,
        document_mask=config.data.document_mask, device=device, autocast=autocast)

