"""The measured runs the planner's error ranges come from (``measured_runs.yaml``): published training and attention
runs, quoted from their sources, and this project's own GPU runs.

Fields a source leaves unstated are absent (``activation_checkpointing``: unknown); ``notes`` says where a value
comes from elsewhere. ``dp`` is the source's data-parallel degree (FSDP shards count there); ``fsdp`` says whether
parameters are sharded over it. ``seq_len`` may exceed the preset's ``max_position_embeddings`` (those runs
extended RoPE): ``model_config()`` raises it. TFLOP/s figures name their convention (``causal_full``: causal
attention counted in full, 6N + 12·L·d·s per token; ``causal_half``: 6N + 6·L·d·s). ``attention_kernel`` is the
kernel the run used (a profile's curve name). ``document_lengths``: the packed documents of its samples, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from cp_train.model.config import ModelConfig
from cp_train.perf.inputs.presets import model_preset

RUNS_FILE = Path(__file__).with_name("measured_runs.yaml")
FLOP_CONVENTIONS = ("causal_full", "causal_half")
UNITS = ("tokens_per_s_per_gpu", "tflops_per_gpu", "attention_fraction_of_ideal")


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: its layout and its measured figures (units in the field names)."""

    key: str
    source: str  # URL or repo + path (@ commit)
    row: str  # the table and row in the source
    model: str  # a preset name (``presets.py``)
    hardware: str  # a hardware profile name (``hardware.py``)
    gpus: int
    seq_len: int  # tokens per sample
    tp: int
    cp: int
    dp: int
    fsdp: bool
    precision: str  # bf16 | fp8 (the linear layers)
    attention_kernel: str
    compiled: bool | None  # None: not PyTorch eager or compiled (Transformer Engine's fused kernels)
    activation_checkpointing: str = "unknown"  # full | selective | none | unknown
    global_batch: int | None = None  # samples per optimizer step
    micro_batch: int | None = None  # samples per micro-batch per replica
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    flop_convention: str | None = None  # for tflops_per_gpu: causal_full | causal_half
    peak_memory_gib: float | None = None
    attention_fraction_of_ideal: float | None = None  # attention-only runs: measured / ideal (one GPU's kernel)
    cp_algorithm: str | None = None  # when the source says
    cp_layout: str | None = None  # when the source says
    vocab_size: int | None = None  # when it is not the preset's
    mlp_chunks: int = 1
    loss_chunk_tokens: int | None = None  # None: the model's default (the fused loss)
    document_lengths: tuple[int, ...] | None = None
    fp8_recipe: str | None = None  # fp8 runs: tensorwise | rowwise (None: one scale per tensor, as TE's)
    notes: str = ""

    @property
    def attention_only(self) -> bool:
        return self.attention_fraction_of_ideal is not None

    @property
    def layout_gpus(self) -> int:
        """tp x cp x dp (equal to ``gpus`` unless ``notes`` explains the source's inconsistency)."""
        return self.tp * self.cp * self.dp

    @property
    def measured(self) -> tuple[float, str]:
        """The headline figure and its unit (one of ``UNITS``; the first the run has)."""
        return next((getattr(self, unit), unit) for unit in UNITS if getattr(self, unit) is not None)

    def model_config(self) -> ModelConfig:
        """The preset, with ``max_position_embeddings`` raised to ``seq_len`` and the run's vocabulary."""
        config = model_preset(self.model)
        return replace(config, max_position_embeddings=max(config.max_position_embeddings, self.seq_len),
                       vocab_size=self.vocab_size or config.vocab_size)


def _run(row: dict[str, Any], sources: dict[str, str]) -> MeasuredRun:
    known = {item.name for item in fields(MeasuredRun)}
    unknown = sorted(set(row) - known)
    if unknown:
        raise ValueError(f"{RUNS_FILE.name}: run {row.get('key')!r} has unknown key {unknown[0]!r}")
    if row.get("fp8_recipe") not in (None, "tensorwise", "rowwise") or (row.get("fp8_recipe") and
                                                                          row.get("precision") != "fp8"):
        raise ValueError(f"{RUNS_FILE.name}: run {row.get('key')!r}: fp8_recipe is tensorwise or rowwise, on fp8 runs")
    values = {**row, "source": sources.get(row["source"], row["source"])}
    if values.get("document_lengths") is not None:
        values["document_lengths"] = tuple(values["document_lengths"])
    return MeasuredRun(**values)


@lru_cache(maxsize=1)
def measured_runs() -> tuple[MeasuredRun, ...]:
    """Every run of ``measured_runs.yaml``, in the file's order."""
    data = yaml.safe_load(RUNS_FILE.read_text(encoding="utf-8"))
    return tuple(_run(row, data["sources"]) for row in data["runs"])


def measured_run(key: str) -> MeasuredRun:
    """The run with ``key``; ``KeyError`` listing the keys otherwise."""
    for run in measured_runs():
        if run.key == key:
            return run
    raise KeyError(f"no measured run {key!r}; the keys are {', '.join(run.key for run in measured_runs())}")
