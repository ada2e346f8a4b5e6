"""Load a Hugging Face Llama, Mistral, Qwen2, Qwen3 or granite_swa model into a ``GPTModel`` (any TP x CP layout)
and save one back; no transformers needed. ``load_llama``/``save_llama`` are the same functions.

    model = load_hf("Qwen2.5-0.5B", state.model_parallel("zigzag"))
    save_hf(model, "out/")             # every rank calls it; global rank 0 writes; the architecture it came from

``load_llama`` builds the ``ModelConfig`` from ``config.json`` (``hf/config.py``), creates the
model without initialising it (meta device) and fills each parameter with this rank's TP shard,
read slice by slice from the safetensors files: a rank never holds more than its shard plus one
read block. ``save_llama`` gathers each tensor over the model's TP group, one at a time, and writes
``config.json`` plus ``model.safetensors`` (or shards and an index) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads as the same function.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cp_train.model.config import ModelConfig, gate_up_block
from cp_train.model.gpt import GPTModel
from cp_train.model.hf.config import hf_config, model_fields, read_hf_config
from cp_train.model.hf.weights import HFTensor, WeightFiles, fused_part, hf_tensors, write_weights
from cp_train.model.meta import allocate, meta_model
from cp_train.model.mlp import gate_up_pairs
from cp_train.model.shards import local_region, local_tensor, tensor_parallel_dim
from cp_train.parallel.mesh.model_parallel import ModelParallel

DEFAULT_SHARD_BYTES = 5 * 2**30

__all__ = ["empty_model", "load_hf", "load_llama", "load_llama_weights", "save_hf", "save_llama"]


def empty_model(config: ModelConfig, parallel: ModelParallel | None = None, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> GPTModel:
    """A ``GPTModel`` with allocated but uninitialised parameters (no random init: built on the meta device)."""
    model = meta_model(config, parallel, dtype)
    allocate(model, device or "cpu")
    return model


def _by_param(config: ModelConfig) -> dict[str, list[HFTensor]]:
    grouped: dict[str, list[HFTensor]] = {}
    for entry in hf_tensors(config):
        grouped.setdefault(entry.param, []).append(entry)
    return grouped


@torch.no_grad()
def load_llama_weights(model: GPTModel, path: str | Path) -> None:
    """Fill every parameter of ``model`` with its block of the HF weights in directory ``path``: its TP shard,
    and with FSDP (DTensor parameters) only its FSDP shard of that (``model.shards.local_region``).

    The weights' shapes must be those ``model.config`` implies (errors name the tensor and file).
    """
    files = WeightFiles(path)
    config = model.config
    tp_size, tp_rank = model.parallel.tp_size, model.parallel.tp_rank
    for name, entries in _by_param(config).items():
        param = model.get_parameter(name)
        for entry in entries:
            if entry.name not in files.files:
                why = " (config.json says tie_word_embeddings = false)" if entry.name == "lm_head.weight" else ""
                raise ValueError(f"tensor {entry.name} is missing from the weights in {path}{why}")
        region, out = local_region(param, tp_rank, tp_size), local_tensor(param)
        if entries[0].part in ("gate", "up"):
            _load_gate_up(files, entries, out, region, gate_up_block(config.ffn_hidden_size))
        elif entries[0].part is not None:
            _load_qkv(files, entries, out, region, config)
        else:
            files.read_block(entries[0].name, entries[0].shape, out, [s.start for s in region])


def _load_qkv(files: WeightFiles, entries: list[HFTensor], out: torch.Tensor, region: tuple[slice, ...],
              config: ModelConfig) -> None:
    """Rows ``region[0]`` (columns ``region[1]``; none for the bias) of the full fused QKV weight or bias, laid out
    per kv head g as its query heads' rows, then k_g, then v_g, read from HF's q, k and v tensors."""
    group, d = config.num_heads // config.num_kv_heads, config.head_dim
    parts = {entry.part: entry for entry in entries}
    rows, columns = region[0], [s.start for s in region[1:]]
    per_head = (group + 2) * d
    for g in range(rows.start // per_head, -(-rows.stop // per_head)):
        base = g * per_head  # fused rows of kv head g: q [base, base+group*d), k, v one head each
        for part, first, count, source in (("q", base, group * d, g * group * d), ("k", base + group * d, d, g * d),
                                           ("v", base + (group + 1) * d, d, g * d)):
            lo, hi = max(first, rows.start), min(first + count, rows.stop)
            if lo < hi:
                entry = parts[part]
                files.read_block(entry.name, entry.shape, out[lo - rows.start:hi - rows.start],
                                 [source + lo - first, *columns])


def _load_gate_up(files: WeightFiles, entries: list[HFTensor], out: torch.Tensor, region: tuple[slice, ...],
                  block: int) -> None:
    """Rows ``region[0]`` (columns ``region[1]``) of the full fused gate/up weight, whose rows alternate ``block``
    rows of HF's gate_proj and of its up_proj (``model.mlp.gate_up_pairs``); each tensor's file opened once."""
    rows, column = region[0], region[1].start
    if rows.start % (2 * block) == 0 and rows.stop % (2 * block) == 0:  # whole blocks: one strided read per part
        ordered = sorted(entries, key=lambda entry: entry.part == "up")  # gate, then up
        for entry, part in zip(ordered, gate_up_pairs(out, block), strict=True):
            files.read_blocks(entry.name, entry.shape, [(part, [rows.start // 2, column])])
        return
    for entry in entries:
        part = int(entry.part == "up")
        reads = []
        for index in range(rows.start // (2 * block), -(-rows.stop // (2 * block))):
            first = (2 * index + part) * block  # this part's rows of block pair ``index``
            lo, hi = max(first, rows.start), min(first + block, rows.stop)
            if lo < hi:
                reads.append((out[lo - rows.start:hi - rows.start], [index * block + lo - first, column]))
        files.read_blocks(entry.name, entry.shape, reads)


def load_hf(path: str | Path, parallel: ModelParallel | None = None, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> GPTModel:
    """The HF model (Llama, Mistral, Qwen2, Qwen3 or granite_swa; ``hf/families.py``) in directory ``path`` as a
    ``GPTModel`` on the TP and CP groups of ``parallel`` (None: no TP or CP), split over CP in its layout and
    attending with its algorithm.

    ``dtype``: parameter dtype (None: torch's default, fp32; the stored weights are cast); ``device``:
    where the parameters live (None: CPU). Each rank reads only its TP shard of every tensor.
    """
    config = ModelConfig(**model_fields(read_hf_config(path)))
    model = empty_model(config, parallel, dtype, device)
    load_llama_weights(model, path)
    return model


def _full_tensor(model: GPTModel, name: str) -> torch.Tensor:
    """Parameter ``name`` of ``model`` at full shape (gathered over FSDP's DP x CP group and then the TP group
    when sharded; collective)."""
    param = model.get_parameter(name)
    tensor = param.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    tp = model.parallel.tp_size
    if tp == 1 or tensor_parallel_dim(param) is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.contiguous(), group=model.parallel.tp_group)
    return torch.cat(parts, dim=tensor_parallel_dim(param))


FullTensor = Callable[[str], torch.Tensor]  # model parameter name -> its full (unsharded) tensor
Producer = Callable[[Iterable[str]], Iterator[tuple[str, torch.Tensor]]]


def hf_tensor_stream(config: ModelConfig, full: FullTensor, dtype: torch.dtype | None = None) -> Producer:
    """``produce(names)`` for ``write_weights``: yields ``(hf_name, tensor)`` from ``full(param_name)``, the full
    model parameter (called once per parameter, in HF order), cast to ``dtype`` (None: as it is) on the CPU."""
    entries = {entry.name: entry for entry in hf_tensors(config)}
    cached: dict[str, torch.Tensor] = {}

    def produce(names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            entry = entries[name]
            if entry.param not in cached:
                cached.clear()
                cached[entry.param] = full(entry.param)
            tensor = cached[entry.param]
            if entry.part is not None:
                tensor = fused_part(tensor, config, entry.part)
            yield name, tensor.to(device="cpu", dtype=dtype or tensor.dtype).clone()
    return produce


def write_hf_model(config: ModelConfig, path: str | Path, full: FullTensor, dtype: torch.dtype, write: bool = True,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` and the weights given by ``full(param_name) -> full tensor`` (see ``hf_tensor_stream``)."""
    path = Path(path)
    text = json.dumps(hf_config(config, str(dtype).removeprefix("torch."), extra_config), indent=2)  # checks first
    if write:
        path.mkdir(parents=True, exist_ok=True)
    element = torch.empty((), dtype=dtype).element_size()
    sizes = [(e.name, element * int(torch.Size(e.shape).numel())) for e in hf_tensors(config)]
    write_weights(path, sizes, hf_tensor_stream(config, full, dtype), max_shard_bytes, write)
    if write:
        (path / "config.json").write_text(text + "\n")
    return path


def save_hf(model: GPTModel, path: str | Path, dtype: torch.dtype | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, extra_config: dict[str, Any] | None = None,
            write: bool | None = None) -> Path:
    """Write ``model`` as an HF model directory (``config.json`` + safetensors) at ``path``; returns ``path``. The
    architecture is the one the model came from (``config.hf_architecture``; granite_swa with sinks; see
    ``families.choose_architecture``); a model no architecture represents exactly is an ``HFConfigError``.

    Collective over ``model.parallel.tp_group`` when TP-sharded: every rank of the world calls it, one tensor
    is gathered at a time. ``write`` (None: global rank 0, or every process without torch.distributed)
    chooses the writer. ``dtype``: stored dtype (None: the parameters'). More than ``max_shard_bytes``
    of weights are written as shards plus ``model.safetensors.index.json``. ``extra_config`` (e.g.
    ``bos_token_id``/``eos_token_id``) goes into config.json.
    """
    if write is None:
        write = not dist.is_initialized() or dist.get_rank() == 0
    dtype = dtype or next(model.parameters()).dtype
    return write_hf_model(model.config, path, lambda name: _full_tensor(model, name), dtype, write,
                          max_shard_bytes, extra_config)


load_llama = load_hf  # the names before the other families
save_llama = save_hf
