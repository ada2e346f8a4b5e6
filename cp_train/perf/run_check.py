"""Every run checks the planner: its prediction (and range) for the run's own layout, and the sanity guard on
measured throughput.

The hardware is ``logging.hardware_profile`` (a profile name or a YAML file, e.g. one written by
``cp-train-plan --calibrate``), else the profile of the CUDA device's name (``metrics.throughput.GPUS``); a CPU
run without a profile, or a GPU without one, is not predicted. A prediction never stops a run: a failure becomes
a note.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from cp_train.config.schema import Config
from cp_train.errors import InputError
from cp_train.memory.dry_run import reserve_gib
from cp_train.memory.offload import HostMemory, ranks_per_node
from cp_train.metrics.throughput import gpu_entry, implausible_mfu
from cp_train.perf.host import GRAPH_SAMPLES
from cp_train.perf.inputs.documents import document_pieces
from cp_train.perf.inputs.hardware import Hardware, load_hardware
from cp_train.perf.predict import predict
from cp_train.perf.rates import DeviceRates, linear_precision


def run_hardware(config: Config, device: torch.device) -> Hardware | None:
    """The profile to predict this run with (see the module docstring); ``InputError`` for a bad profile."""
    if config.logging.hardware_profile:
        return load_hardware(config.logging.hardware_profile)
    if device.type != "cuda":
        return None
    profile = device_profile(torch.cuda.get_device_name(device))
    return load_hardware(profile) if profile else None


def device_profile(name: str) -> str | None:
    """The built-in hardware profile of a CUDA device named ``name`` (``metrics.throughput.GPUS``), or None."""
    entry = gpu_entry(name)
    return entry[1] if entry else None


def sample_documents(dataset: Any, samples: int = GRAPH_SAMPLES) -> tuple[int, ...] | None:
    """The lengths of the document pieces in the first ``samples`` samples of ``dataset`` (items with
    ``document_ids``, ``data/gpt_dataset.py``), in order; None when it has none."""
    try:
        pieces: list[int] = []
        for index in range(min(samples, len(dataset))):
            ids = dataset[index]["document_ids"]
            pieces += torch.unique_consecutive(ids, return_counts=True)[1].tolist()
    except (KeyError, TypeError, IndexError):
        return None
    return tuple(pieces) or None


def run_prediction(config: Config, world: int, device: torch.device, documents: tuple[int, ...] | None = None
                   ) -> tuple[dict[str, Any] | None, str | None]:
    """``(prediction, note)``: the planner's step time, tokens/s per device, MFU and peak memory for ``config``
    on ``world`` ranks of this run's hardware (None when there is none), and a note when it could not be made.
    ``documents``: the lengths of the documents packed into its samples (``sample_documents``; None: one per
    sample)."""
    try:
        hardware = run_hardware(config, device)
        if hardware is None:
            return None, None
        ragged = "cudnn_ragged" if config.model.attention_kernel == "cudnn_ragged" else None  # documents on cuDNN
        rates = DeviceRates(hardware, linear_precision(config.model.fp8), ragged)  # FP8 linears planned as such
        planned = predict(copy.deepcopy(config), world, rates, hardware.peak_tflops("bf16"), hardware.hbm_gib,
                          reserve_gib(hardware.hbm_gib), documents)
    except (InputError, ValueError, KeyError) as error:
        return None, f"no planner prediction for this run: {error}"
    record = planned.record()
    if record["mfu"]["causal_half"] > 1:
        profile = config.logging.hardware_profile or "built in"
        return None, (f"the planner predicts MFU {record['mfu']['causal_half']:.0%} on {hardware.name}, above the "
                      f"hardware's peak: the profile's rates are wrong ({profile})")
    return {"hardware": hardware.name, "step_time_s": record["step_time_s"],
            "step_time_s_range": record["step_time_s_range"], "regime": record["regime"],
            "documents_per_sample": len(document_pieces(documents, config.data.seq_len)) if documents else 1,
            "tokens_per_s_per_device": record["tokens_per_s_per_gpu"], "mfu": record["mfu"]["causal_half"],
            "memory_gib": record["memory_gib"]["total"], "fits": record["fits"],
            "tokens_per_s_per_device_range": record["tokens_per_s_per_gpu_range"],
            "offload_exposed_s": record["breakdown_s"]["offload"], "pcie_gb_s": hardware.pcie_gb_s}, None


def dry_run_line(config: Config, world: int) -> str | None:
    """``--dry-run``'s prediction line: the run's step on ``logging.hardware_profile``, else on this machine's
    GPU, else (a CUDA run planned from a machine without one) on an H100 SXM; None for a CPU run without a
    profile."""
    if not config.logging.hardware_profile and config.parallel.backend == "gloo":
        return None
    local = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    chosen = copy.deepcopy(config)
    if not chosen.logging.hardware_profile and local.type != "cuda":
        chosen.logging.hardware_profile = "h100-sxm"
    prediction, note = run_prediction(chosen, world, local)
    if prediction is None:
        return note
    low, high = prediction["step_time_s_range"]
    slow, fast = prediction["tokens_per_s_per_device_range"]
    offload = ""
    if config.model.activation_offload != "none":
        exposed = prediction["offload_exposed_s"]
        offload = (f"; activation offload over PCIe at {prediction['pcie_gb_s']:g} GB/s: "
                   + (f"{exposed:.3g} s exposed per step" if exposed > 0 else "hidden behind each block's compute"))
    return (f"planner ({prediction['hardware']}; cp-train-plan for other layouts): a step of "
            f"{config.train.global_batch_size * config.data.seq_len:,} tokens in {prediction['step_time_s']:.3g} s "
            f"(runs like it: {low:.3g}-{high:.3g} s), {prediction['tokens_per_s_per_device']:,.0f} tokens/s per "
            f"device ({slow:,.0f}-{fast:,.0f}), MFU {prediction['mfu']:.1%} (causal attention at half){offload}")


def dry_run_host(config: Config, world: int) -> HostMemory | None:
    """A node's host memory for ``--dry-run``'s offload check: the ``host_memory_gib`` of the profile
    ``dry_run_line`` predicts with (None for a CPU run without one, or an unreadable profile), shared by
    ``LOCAL_WORLD_SIZE`` or ``min(world, gpus_per_node)`` ranks."""
    if not config.logging.hardware_profile and config.parallel.backend == "gloo":
        return None
    name = config.logging.hardware_profile
    if not name and torch.cuda.is_available():
        name = device_profile(torch.cuda.get_device_name(torch.device("cuda")))
    try:
        hardware = load_hardware(name or "h100-sxm")
    except InputError:
        return None
    return HostMemory(hardware.host_memory_gib, ranks_per_node(world, hardware.gpus_per_node),
                      f"{hardware.name}'s host_memory_gib")


def measured_against_predicted(step_time_s: float, prediction: dict[str, Any] | None) -> str | None:
    """The final summary's comparison line, or None without a prediction."""
    if not prediction or not step_time_s:
        return None
    ratio = step_time_s / prediction["step_time_s"]
    low, high = prediction["step_time_s_range"]
    where = "inside" if low <= step_time_s <= high else "outside"
    return (f"step time {step_time_s:.3g} s measured / {prediction['step_time_s']:.3g} s predicted by the planner "
            f"on {prediction['hardware']} = {ratio:.2f} ({where} the range of runs like it, {low:.3g}-{high:.3g} s)")


def measured_against_planned_memory(peak_gib: float, prediction: dict[str, Any] | None) -> str | None:
    """The final summary's memory line (the peak allocated on a GPU, max over ranks, against the dry run's plan of
    the largest rank, the reserve left out), or None without a prediction or a peak."""
    if not prediction or not peak_gib or not prediction.get("memory_gib"):
        return None
    planned = prediction["memory_gib"]
    return (f"peak memory {peak_gib:.3g} GiB allocated / {planned:.3g} GiB planned by the dry run = "
            f"{peak_gib / planned:.2f}")


class PlannerCheck:
    """One run's check of the planner: the prediction made at the start (``prediction``, and ``notes`` when it
    could not be made), the measured MFU guarded at every logged interval (warned once), and the final
    measured / predicted lines: the median logged step time (the first interval, with compilation and warm-up,
    left out when there are others) and, on a GPU, the peak allocated memory against the dry run's plan."""

    def __init__(self, config: Config, world: int, device: torch.device, peak_tflops: float, peak_source: str,
                 dataset: Any = None) -> None:
        documents = sample_documents(dataset) if dataset is not None and config.data.document_mask else None
        self.prediction, note = run_prediction(config, world, device, documents)
        self.notes = [note] if note else []
        self.peak_tflops, self.peak_source = peak_tflops, peak_source
        self.step_times: list[float] = []
        self.peak_gib = 0.0  # the largest logged peak over ranks (a GPU's allocated bytes; not read on CPU: RSS)
        self.gpu = device.type == "cuda"
        self.warned = False

    def observe(self, record: dict[str, Any]) -> list[str]:
        """Take one logged ``train`` record; the lines to print (the MFU warning, once)."""
        self.step_times.append(record["step_time_s"])
        if self.gpu:
            self.peak_gib = max(self.peak_gib, record.get("peak_memory_max_gib") or 0.0)
        warning = None if self.warned else implausible_mfu(record["mfu"], self.peak_tflops, self.peak_source)
        self.warned = self.warned or warning is not None
        return [warning] if warning else []

    def summary(self) -> list[str]:
        times = self.step_times[1:] or self.step_times
        lines = [measured_against_predicted(statistics.median(times), self.prediction) if times else None,
                 measured_against_planned_memory(self.peak_gib, self.prediction)]
        return [line for line in lines if line]

