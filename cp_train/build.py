"""Building a run's pieces from its config: device, data (datasets and loaders), model, directories.

Problems with the inputs (tokenizer, data files, writable directories) are ``InputError``s naming the key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from cp_train.config.schema import Config, ConfigError
from cp_train.data.blend_spec import parse_blend, size_weights
from cp_train.data.blended import (
    BlendedDataset,
    blended_sample_counts,
    cached_blend_schedule,
)
from cp_train.data.default_corpus import prepare_default_corpus
from cp_train.data.gpt_dataset import GPTDataset, train_valid_split
from cp_train.data.indexed import IndexedDataset
from cp_train.data.loader import StepLoader, build_data_loader
from cp_train.data.sample_index import cache_dir_of
from cp_train.data.tokenizers.load import load_tokenizer, padded_vocab_size
from cp_train.errors import InputError, agree
from cp_train.model.family import get_model_family
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import load_llama_weights
from cp_train.model.meta import allocate, materialize, meta_model
from cp_train.model.parallelize import shard_with_fsdp
from cp_train.model.shards import full_shape, local_tensor
from cp_train.parallel.cp.plan.batch_plan import SamplePlanner
from cp_train.parallel.dp.ddp import replicate_with_ddp
from cp_train.parallel.mesh.groups import run_device
from cp_train.parallel.mesh.state import ParallelState
from cp_train.parallel.tp.fp8 import convert_to_fp8, fp8_unavailable


def select_device(state: ParallelState) -> torch.device:
    """This rank's CUDA device under nccl, else the CPU (the device its groups were connected on)."""
    return run_device(state.backend)


def autocast_dtype(config: Config, device: torch.device) -> torch.dtype | None:
    """bf16 autocast for ``train.dtype`` bf16, or auto on CUDA; None (no autocast) otherwise."""
    dtype = config.train.dtype
    return torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device.type == "cuda") else None


def use_deterministic_algorithms() -> None:
    """Deterministic kernels from here on (cuBLAS needs its workspace setting before its first use);
    the attention kernels follow it too (see ``cp_train.parallel.kernels.select``)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _one_per_node_first(state: ParallelState, work) -> object:  # noqa: ANN001 - any callable
    """Run ``work()`` on local rank 0 first (it may write caches), then on the other ranks; a
    ``CpTrainError`` of the first run stops every rank alike."""
    local_rank = int(os.environ.get("LOCAL_RANK", state.rank))
    result = agree(work if local_rank == 0 else lambda: None)
    return result if local_rank == 0 else work()


@contextmanager
def input_errors(what: str) -> Iterator[None]:
    """Turn the data code's errors about its files (missing, truncated, too small, unwritable cache) into
    an ``InputError`` starting with ``what`` (the config key and value)."""
    try:
        yield
    except PermissionError as error:
        raise InputError(f"{what}: {error}: make it writable, or set data.cache_dir to a writable "
                         f"directory for the sample-index cache") from None
    except (OSError, ValueError) as error:
        if isinstance(error, InputError):
            raise
        raise InputError(f"{what}: {error}") from None


@dataclass
class DataSources:
    prefix: str  # one dataset's prefix or a blend's ``W1 PREFIX1 W2 PREFIX2 ...`` (``data/blended.py``)
    tokenizer: str | None
    eod_id: int
    pad_id: int | None
    vocab_size: int  # the model's (padded) vocabulary
    valid_prefix: str | None = None  # ``data.valid_prefix``: the validation data, read whole

    @property
    def eval_prefix(self) -> str:
        """The dataset the long-context eval draws its held-out documents from: the first of the validation data's
        blend (``data.valid_prefix``), else of the training data's."""
        if self.valid_prefix:
            return parse_blend(self.valid_prefix, "data.valid_prefix")[0][1]
        return parse_blend(self.prefix)[0][1]


def resolve_data(config: Config, state: ParallelState) -> DataSources:
    """Data prefix and tokenizer (the embedded default corpus, built if missing, when ``data.prefix`` is
    unset); fills ``model.vocab_size`` from the tokenizer (padded to a multiple of 128) when it is unset."""
    prefix, tokenizer_path = config.data.prefix, config.data.tokenizer
    if prefix is None:
        corpus = _one_per_node_first(state, prepare_default_corpus)
        prefix, tokenizer_path = str(corpus.data_prefix), tokenizer_path or str(corpus.tokenizer_model)
    eod, pad, vocab = config.data.eod_id, None, config.model.vocab_size
    if tokenizer_path is not None:
        with input_errors(f"data.tokenizer {tokenizer_path}"):
            tokenizer = load_tokenizer(tokenizer_path)
        hf = config.checkpoint.init_from_hf
        if vocab is not None and vocab < tokenizer.vocab_size and hf:  # the HF config fixes the vocabulary
            raise ConfigError(f"the Hugging Face model {hf} has {vocab} token ids, fewer than the "
                              f"{tokenizer.vocab_size} of the tokenizer {tokenizer_path}: train it with its own "
                              f"tokenizer, --tokenizer-model {hf} (data.tokenizer), on data tokenized with it "
                              f"(cp-train-preprocess, then --data-path)")
        elif vocab is not None and vocab < tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size {vocab} is smaller than the {tokenizer.vocab_size} ids of the "
                              f"tokenizer {tokenizer_path}: set model.vocab_size >= {tokenizer.vocab_size} (e.g. "
                              f"{padded_vocab_size(tokenizer.vocab_size)}) or null to take it from the tokenizer")
        eod = tokenizer.eod if eod is None else eod
        pad = tokenizer.pad
        vocab = vocab or padded_vocab_size(tokenizer.vocab_size)
    if vocab is None or eod is None:
        raise ConfigError("set data.tokenizer, or model.vocab_size and data.eod_id")
    if not 0 <= eod < vocab:
        raise ConfigError(f"data.eod_id {eod} is outside the vocabulary of model.vocab_size {vocab}")
    config.model.vocab_size = vocab
    return DataSources(prefix, tokenizer_path, eod, pad, vocab, config.data.valid_prefix)


Part = tuple[float | None, IndexedDataset, np.ndarray]  # a blend's (weight, dataset, documents of the split)


def build_datasets(config: Config, sources: DataSources, state: ParallelState
                   ) -> tuple[Dataset, Dataset | None]:
    """Train (``steps * global_batch_size`` samples) and validation (``valid_iters`` global batches) datasets; sample
    indices are cached (built once per node). Validation reads ``data.valid_prefix`` whole where it is set, else the
    last ``data.valid_fraction`` of each dataset of ``data.prefix``. A blend (``W1 PREFIX1 W2 ...``, or ``PREFIX1
    PREFIX2 ...`` weighed by each split's tokens; ``data/blended.py``) serves its datasets' samples in proportion to
    the weights, in either split."""
    data, train = config.data, config.train
    splits = [(weight, *_split(config, prefix, sources.vocab_size)) for weight, prefix in parse_blend(sources.prefix)]
    training = [(weight, indexed, train_docs) for weight, indexed, train_docs, _ in splits]
    validation = [(weight, indexed, valid_docs) for weight, indexed, _, valid_docs in splits]
    if sources.valid_prefix:
        validation = [(weight, _open(prefix, "data.valid_prefix", sources.vocab_size), None)
                      for weight, prefix in parse_blend(sources.valid_prefix, "data.valid_prefix")]
    validating = train.valid_interval > 0 and all(docs is None or docs.size for _, _, docs in validation)
    common = {"seed": data.seed, "eod_id": sources.eod_id, "pad_id": sources.pad_id,
              "mask_eod_loss": data.mask_eod_loss, "reset_position_ids": data.reset_position_ids,
              "cache_dir": data.cache_dir}

    def datasets(name: str, parts: list[Part], samples: int) -> Dataset:
        blend = [(weight, indexed.prefix) for weight, indexed, _ in parts]
        tokens = [indexed.num_tokens if docs is None else int(indexed.sequence_lengths[docs].astype(np.int64).sum())
                  for _, indexed, docs in parts]
        weights = size_weights(blend, tokens)
        key = "data.prefix" if parts[0][2] is not None else "data.valid_prefix"  # whole datasets: valid_prefix's
        schedule = None  # one dataset; a blend's schedule is made once per split and node, then read
        if len(parts) > 1:
            first = parts[0][1].prefix
            with input_errors(f"{key} {first}"):
                schedule = cached_blend_schedule(weights, samples, cache_dir_of(data.cache_dir, first), name)
        counts = blended_sample_counts(weights, samples, schedule) if schedule is not None else [samples]
        made = []
        for (_, indexed, docs), count in zip(parts, counts, strict=True):
            with input_errors(f"{key} {indexed.prefix}"):
                made.append(GPTDataset(indexed, data.seq_len, max(count, 1), name=name, documents=docs, **common))
        return made[0] if schedule is None else BlendedDataset(made, weights, samples, schedule)

    def make() -> tuple[Dataset, Dataset | None]:
        samples = train.steps * train.global_batch_size
        valid_samples = train.valid_iters * train.global_batch_size
        return (datasets("train", training, samples),
                datasets("valid", validation, valid_samples) if validating else None)

    return _one_per_node_first(state, make)  # type: ignore[return-value]


def _open(prefix: str, key: str, vocab_size: int) -> IndexedDataset:
    """The indexed dataset at ``prefix`` (of config key ``key``), its tokens checked against the vocabulary."""
    with input_errors(f"{key} {prefix}"):
        indexed = IndexedDataset(prefix)
        indexed.check_vocab(vocab_size)
    return indexed


def _split(config: Config, prefix: str, vocab_size: int) -> tuple[IndexedDataset, np.ndarray, np.ndarray]:
    """The indexed dataset at ``prefix`` and its (train, validation) documents (``data.held_out_fraction``)."""
    indexed = _open(prefix, "data.prefix", vocab_size)
    fraction = config.data.held_out_fraction
    if fraction <= 0:
        return indexed, np.arange(indexed.num_documents), np.arange(0)
    train_docs, valid_docs = train_valid_split(indexed.num_documents, fraction)
    if not valid_docs.size and config.train.valid_interval > 0:
        raise ConfigError(f"data.valid_fraction {fraction} leaves no validation document of the "
                          f"{indexed.num_documents} in {prefix}: raise it to at least "
                          f"{1 / indexed.num_documents:.3g}, or set train.valid_interval=0")
    return indexed, train_docs, valid_docs


def build_loader(config: Config, dataset: Dataset, state: ParallelState, consumed_samples: int,
                 device: torch.device, planner: SamplePlanner | None = None) -> StepLoader:
    """This rank's loader: DP rank's samples from ``consumed_samples`` on, CP slice in the model's layout.

    On CUDA the batches are prefetched by worker processes (``data.num_workers``, default 2) into
    pinned memory, so the trainer's non-blocking copy overlaps the GPU's work; with a ``planner``
    (``GPTModel.sample_planner``) each micro-batch's CP plan is made there too."""
    cuda = device.type == "cuda"
    workers = config.data.num_workers if config.data.num_workers is not None else (2 if cuda else 0)
    return build_data_loader(dataset, config.train.micro_batch_size, config.train.global_batch_size,
                             dp_rank=state.dp.rank, dp_size=state.dp.size, cp_rank=state.cp.rank,
                             cp_size=state.cp.size, layout=config.parallel.cp_layout,
                             consumed_samples=consumed_samples, num_workers=workers, pin_memory=cuda,
                             planner=planner)


BUILD_ON_META = True  # False: build the full model on the device first (the tests compare both builds)


def build_model(config: Config, state: ParallelState, device: torch.device, hf_dir: str | None = None,
                param_dtype: torch.dtype | None = None) -> tuple[GPTModel, nn.Module]:
    """The GPT on this rank's TP and CP groups with fp32 parameters, and the module to call for training.

    Built on the meta device, then (``parallel.fsdp``) sharded with FSDP2 over DP x CP, then given storage
    for its local shards only, filled from the seeded initialisation or, with ``hf_dir``, from this rank's
    blocks of the Hugging Face weights there. ``model.fp8``: the blocks' linears compute in FP8 (converted before
    compiling and sharding; ``ConfigError`` when torchao or the GPU cannot). Without FSDP the model is wrapped in
    DDP over DP x CP. Both SUM the gradients over DP x CP (``cp_train.parallel.dp.ddp``, ``model/parallelize.py``).
    ``param_dtype`` (bf16 runs): the dtype FSDP gathers the parameters in. ``train.compile``: each block and the
    head with its loss are compiled (``GPTModel.compile_parts``) before FSDP wraps them. Returns ``(model, module)``:
    ``module`` is the DDP wrapper or the model."""
    parallel = config.parallel
    model_parallel = state.model_parallel(parallel.cp_layout, parallel.cp_algorithm, parallel.sequence_parallel_on)
    on_meta = BUILD_ON_META or hf_dir is not None
    try:
        if on_meta:
            model = meta_model(config.model, model_parallel)
        else:
            model = get_model_family(config.model.family).build(config.model, model_parallel, device=device)
    except ImportError as error:  # an optional package the config asks for (model.norm apex) is missing
        raise ConfigError(str(error)) from None
    problem = fp8_unavailable(config.model.fp8, device)  # torchao missing, or a GPU without FP8
    if problem:
        raise ConfigError(problem)
    # the blocks' linears (parallel/tp/fp8.py; their shapes: validate); the LM head and the embedding stay in the
    # compute dtype; under FSDP tensorwise gathers in FP8 the weights that split evenly over its shard group
    convert_to_fp8(model.layers, config.model.fp8, device, fsdp_shards=state.fsdp_shard.size if parallel.fsdp else 0,
                   prefix="layers.", indices=config.model.fp8_blocks, fast_accum=config.model.fp8_fast_accum)
    if config.train.compile:
        model.compile_parts()
    if parallel.fsdp:
        shard_with_fsdp(model, state.fsdp_mesh, parallel.fsdp_reshard_after_forward, param_dtype)
    if on_meta:
        allocate(model, device)
        if hf_dir is None:
            materialize(model)
        else:
            load_llama_weights(model, hf_dir)
    if parallel.fsdp:
        return model, model
    return model, replicate_with_ddp(model, state.dp_cp.group, config.train.grad_bucket_mb)


def describe(model: nn.Module, state: ParallelState) -> dict[str, int]:
    """Parameter counts: this rank's (its TP and FSDP shards), and the whole model's."""
    params = list(model.parameters())
    return {"parameters": sum(full_shape(p, state.tp.size).numel() for p in params),
            "parameters_per_rank": sum(local_tensor(p).numel() for p in params)}


def run_dir_of(config: Config, run_name: str) -> Path:
    return Path(config.logging.dir) if config.logging.dir else Path("runs") / run_name
