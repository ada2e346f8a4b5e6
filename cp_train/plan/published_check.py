"""The planner against published runs (``published.py``): each row's layout predicted on its hardware, in the
row's own unit, with nothing fitted to any row.

Settings a source leaves out are the planner's choice: activation checkpointing ``unknown`` is the fastest mode
that fits; a CP algorithm not stated is the source framework's default (torchtitan's all-gather, Transformer
Engine's ring); the layout is zigzag (both frameworks' load-balanced layout). The attention kernel is the one the
source framework ran: PyTorch SDPA's FlashAttention-2 for torchtitan and ring-flash-attn, cuDNN's fused
attention for NeMo (Transformer Engine's default on Hopper and Blackwell).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from cp_train.config.schema import Config
from cp_train.memory.dry_run import reserve_gib
from cp_train.plan.inputs.hardware import Hardware, load_hardware
from cp_train.plan.inputs.published import PublishedRun
from cp_train.plan.predict import Prediction, predict
from cp_train.plan.rates import DeviceRates
from cp_train.plan.time_model import attention_seconds
from cp_train.plan.workload import build_workload


def source_kernel(run: PublishedRun, hardware: Hardware) -> str | None:
    """The attention kernel the source ran, where the profile has its curve (else None: the profile's own)."""
    kernel = "cudnn" if "NeMo" in run.source else "flash2"
    return kernel if any(curve.kernel == kernel for curve in hardware.attention) else None


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    predicted: float
    measured: float
    unit: str
    prediction: Prediction | None  # None for attention-only rows

    @property
    def error(self) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predicted / self.measured - 1


def run_config(run: PublishedRun, checkpointing: str) -> Config:
    """The trainer config of ``run``'s layout (CUDA, bf16 compute)."""
    config = Config()
    config.model = run.model_config()
    config.model.activation_checkpointing = checkpointing
    config.data.seq_len = run.seq_len
    p = config.parallel
    p.tp, p.cp, p.dp, p.fsdp = run.tp, run.cp, run.dp, run.fsdp
    p.cp_algorithm = run.cp_algorithm or ("allgather" if "torchtitan" in run.source else "ring")
    p.cp_layout = run.cp_layout or "zigzag"
    config.train.micro_batch_size = run.micro_batch or 1
    config.train.global_batch_size = run.global_batch or run.dp * config.train.micro_batch_size
    config.train.dtype = "bf16"
    config.train.compile = run.compiled is not False  # NeMo (None): Transformer Engine's fused kernels
    config.logging.wandb = False
    return config


def _attention_only(run: PublishedRun, rates: DeviceRates) -> float:
    """Measured / ideal of the ring's forward + backward: ideal is the whole causal attention split evenly over
    the GPUs at one GPU's rate on its own tokens (``cp`` times one GPU's kernel on ``seq/cp`` tokens)."""
    config = run_config(run, "none")
    world = run.tp * run.cp * run.dp
    ring = build_workload(config, world, 2)
    forward, backward, exposed_f, exposed_b = attention_seconds(ring, rates)
    single = copy.deepcopy(config)
    single.parallel.cp, single.data.seq_len = 1, run.seq_len // run.cp
    local = build_workload(single, 1, 2)
    ideal_f, ideal_b, _, _ = attention_seconds(local, rates)
    return run.cp * (ideal_f + ideal_b) / (forward + backward + exposed_f + exposed_b)


def compare(run: PublishedRun) -> Comparison:
    """``run`` predicted in its own unit (see the module docstring)."""
    hardware = load_hardware(run.hardware)
    rates = DeviceRates(hardware, run.precision, source_kernel(run, hardware))
    measured, unit = run.measured
    if run.attention_only:
        return Comparison(run, _attention_only(run, rates), measured, unit, None)
    reserve = reserve_gib(hardware.hbm_gib)
    modes = ("none", "selective", "full") if run.activation_checkpointing == "unknown" else (
        run.activation_checkpointing,)
    predictions = [predict(run_config(run, mode), run.layout_gpus, rates, hardware.peak_tflops("bf16"),
                           hardware.hbm_gib, reserve) for mode in modes]
    fitting = [p for p in predictions if p.fits] or predictions
    best = max(fitting, key=lambda p: p.tokens_per_s_per_gpu)
    if unit == "tokens_per_s_per_gpu":
        predicted = best.tokens_per_s_per_gpu
    else:
        predicted = best.tflops_per_gpu(run.flop_convention or "causal_full")
    return Comparison(run, predicted, measured, unit, best)
