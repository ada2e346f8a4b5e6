"""Which Hugging Face tensor feeds which ``GPTModel`` parameter, and safetensors files in and out.

Mapping (HF -> model): ``model.embed_tokens`` -> ``embedding``; ``input_layernorm`` /
``post_attention_layernorm`` -> ``attention_norm`` / ``mlp_norm``; ``q_proj``/``k_proj``/``v_proj``
(weights and biases) -> the fused ``attention.qkv``, laid out per kv head g as its ``heads/kv_heads`` query
heads, then k_g, then v_g; ``o_proj`` (weight and bias) -> ``attention.proj``; ``q_norm``/``k_norm`` ->
``attention.q_norm``/``k_norm``; ``sinks`` -> ``attention.sinks``; ``gate_proj``/``up_proj`` -> the fused
``mlp.gate_up``, whose rows alternate blocks of gate's and up's rows (``model.mlp.gate_up_pairs``); ``down_proj`` ->
``mlp.down``;
``model.norm`` -> ``norm``; ``lm_head`` -> ``lm_head`` (absent when the embeddings are tied).

``WeightFiles(dir)`` reads ``model.safetensors`` or the shards named by
``model.safetensors.index.json``; ``read_block`` copies a block of one tensor into a preallocated
tensor in blocks, opening the file for that tensor only, so a reader's memory stays near the
size of what it keeps. ``write_weights`` writes tensors produced one at a time into shards.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cp_train.model.config import ModelConfig, gate_up_block
from cp_train.model.mlp import gate_up_pairs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BLOCK_ELEMENTS = 1 << 24  # elements per read block (64 MiB of fp32)


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor: its name and full shape, the model parameter it belongs to, and for q/k/v its part."""

    name: str
    shape: tuple[int, ...]
    param: str
    part: str | None = None  # "q", "k" or "v" of the fused attention.qkv, "gate" or "up" of mlp.gate_up


def _attention_tensors(config: ModelConfig, hf: str, ours: str) -> list[HFTensor]:
    """One layer's attention tensors: q/k/v (weights, and biases when biased), o, qk-norms, sinks."""
    h, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    qkv_bias, proj_bias = config.has_bias
    out = []
    for kind, biased in (("weight", True), ("bias", qkv_bias)):
        if biased:
            columns = (h,) if kind == "weight" else ()
            out += [HFTensor(f"{hf}.self_attn.{part}_proj.{kind}", (rows, *columns), f"{ours}.attention.qkv.{kind}",
                             part) for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
    out.append(HFTensor(f"{hf}.self_attn.o_proj.weight", (h, q_rows), f"{ours}.attention.proj.weight"))
    if proj_bias:
        out.append(HFTensor(f"{hf}.self_attn.o_proj.bias", (h,), f"{ours}.attention.proj.bias"))
    if config.qk_norm:
        out += [HFTensor(f"{hf}.self_attn.{x}_norm.weight", (d,), f"{ours}.attention.{x}_norm.weight") for x in "qk"]
    if config.attention_sinks:
        out.append(HFTensor(f"{hf}.self_attn.sinks", (config.num_heads,), f"{ours}.attention.sinks"))
    return out


def hf_tensors(config: ModelConfig) -> list[HFTensor]:
    """Every tensor of the HF checkpoint of ``config``, in HF's order."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    out = [HFTensor("model.embed_tokens.weight", (config.vocab_size, h), "embedding.weight")]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        out += [HFTensor(f"{hf}.input_layernorm.weight", (h,), f"{ours}.attention_norm.weight"),
                *_attention_tensors(config, hf, ours),
                HFTensor(f"{hf}.post_attention_layernorm.weight", (h,), f"{ours}.mlp_norm.weight"),
                *(HFTensor(f"{hf}.mlp.{part}_proj.weight", (ffn, h), f"{ours}.mlp.gate_up.weight", part)
                  for part in ("gate", "up")),
                HFTensor(f"{hf}.mlp.down_proj.weight", (h, ffn), f"{ours}.mlp.down.weight")]
    out.append(HFTensor("model.norm.weight", (h,), "norm.weight"))
    if not config.tie_embeddings:
        out.append(HFTensor("lm_head.weight", (config.vocab_size, h), "lm_head.weight"))
    return out


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The full fused ``[(heads + 2 kv_heads) * d, hidden]`` weight (or ``[(heads + 2 kv_heads) * d]`` bias) as
    HF's ``{"q", "k", "v"}``."""
    kv, group, d = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    rest = tuple(qkv.shape[1:])
    grouped = qkv.view(kv, group + 2, d, *rest)
    return {"q": grouped[:, :group].reshape(kv * group * d, *rest), "k": grouped[:, group].reshape(kv * d, *rest),
            "v": grouped[:, group + 1].reshape(kv * d, *rest)}


def fused_part(tensor: torch.Tensor, config: ModelConfig, part: str) -> torch.Tensor:
    """HF's tensor ``part`` of a full fused parameter: q, k or v of ``attention.qkv``, gate or up of
    ``mlp.gate_up``."""
    if part in ("gate", "up"):
        return gate_up_pairs(tensor, gate_up_block(config.ffn_hidden_size))[part == "up"].flatten(0, 1)
    return split_qkv(tensor, config)[part]


class WeightFiles:
    """The safetensors weights of an HF model directory: which file holds each tensor, and reads of slices."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index} is not a safetensors index (no weight_map): {error}") from None
            self.files = {name: self.path / file for name, file in weight_map.items()}
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise FileNotFoundError(f"{file.name}, listed in {index}, is missing from {self.path}")
        elif single.is_file():
            with safe_open(single, framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), single)
        else:
            others = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
            hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
            raise FileNotFoundError(f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def file_of(self, name: str) -> Path:
        if name not in self.files:
            raise KeyError(f"tensor {name} is not in the weights of {self.path}")
        return self.files[name]

    def read_block(self, name: str, shape: tuple[int, ...], out: torch.Tensor, starts: list[int]) -> None:
        """Copy the block of ``tensor[name]`` that starts at ``starts`` (one index per dim) and has ``out``'s shape
        into ``out`` (cast to its dtype), in blocks of rows, checking that the stored tensor has the full
        ``shape``."""
        self.read_blocks(name, shape, [(out, starts)])

    def read_blocks(self, name: str, shape: tuple[int, ...], blocks: Iterable[tuple[torch.Tensor, list[int]]]) -> None:
        """``read_block`` for each ``(out, starts)`` of ``blocks``, the file opened once. A 3-D ``out`` ``[k, rows,
        columns]`` (a strided view, say) takes ``k * rows`` consecutive rows."""
        file = self.file_of(name)
        with safe_open(file, framework="pt") as handle:
            view = handle.get_slice(name)
            stored = tuple(view.get_shape())
            if stored != tuple(shape):
                raise ValueError(f"tensor {name} in {file} has shape {list(stored)}; the config implies {list(shape)}")
            for out, starts in blocks:
                if out.numel() == 0:
                    continue
                if out.dim() == 1:
                    out.copy_(view[starts[0]:starts[0] + out.shape[0]])
                    continue
                (row, column), width = starts, out.shape[-1]
                per = out.shape[1] if out.dim() == 3 else 1  # rows per index of out's first dim
                block = max(1, BLOCK_ELEMENTS // max(1, width * per))
                for first in range(0, out.shape[0], block):
                    last = min(out.shape[0], first + block)
                    rows = view[row + first * per:row + last * per, column:column + width]
                    out[first:last].copy_(rows.view(out[first:last].shape))


def plan_shards(tensors: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into consecutive shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in tensors:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(path: Path, sizes: list[tuple[str, int]],
                  produce: Callable[[Iterable[str]], Iterator[tuple[str, torch.Tensor]]], max_shard_bytes: int,
                  write: bool) -> None:
    """Write ``produce(names)`` (the tensors of each shard, in order) as ``model.safetensors``, or as shards and
    an index when the total exceeds ``max_shard_bytes``. Every caller runs ``produce`` (it may be collective);
    only ``write`` callers touch the files."""
    shards = plan_shards(sizes, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):
        if not write:  # take part in the (collective) production, keep nothing
            for _ in produce(shard):
                pass
            continue
        tensors = {name: tensor.contiguous() for name, tensor in produce(shard)}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if write and len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes for _, nbytes in sizes)}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if write:
        remove_stale_weights(path, set(names) | ({INDEX_FILE} if len(shards) > 1 else set()))


def remove_stale_weights(path: Path, written: set[str]) -> None:
    """Delete the safetensors weights and index an earlier save left in ``path`` (other shard counts): loaders
    would otherwise read them (transformers prefers ``model.safetensors`` to an index)."""
    for old in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        if old.is_file() and old.name not in written:
            old.unlink()
