"""A hardware profile (``hardware.py``) as the rates the time model asks for (``time_model.Rates``)."""

from __future__ import annotations

import math

from cp_train.plan.inputs.hardware import Hardware
from cp_train.plan.workload import KernelCall

# memory-bound kernels (norms, adds, SwiGLU, AdamW) reach about this fraction of the HBM bandwidth: a STREAM
# copy on H100 SXM reaches ~3.0 of 3.35 TB/s (stas00/ml-engineering compute/accelerator/README.md, memory
# bandwidth table; NVIDIA's own nvbandwidth device-local copy figures agree within a few percent)
MEMORY_EFFICIENCY = 0.85


class DeviceRates:
    """``hardware``'s rates with linears in ``precision`` (default: the profile's compute dtype; bf16 or fp8 on a
    GPU, fp8 for comparison with published fp8 runs; attention stays in the compute dtype) and attention by
    ``kernel`` (default: the profile's, the trainer's choice), for one rank of a layout of ``world`` ranks.

    A GPU's rates are its own whatever the world. A CPU profile's (``hardware.cpu``) are one core's, scaled by
    ``CpuConstants.compute_scale(world)`` (threads per rank, or ranks sharing the cores), with the host time per
    op (``op_seconds``) slowed when the ranks outnumber the cores and gloo's measured links at the world size."""

    def __init__(self, hardware: Hardware, precision: str | None = None, kernel: str | None = None,
                 world: int = 1) -> None:
        precision = precision or hardware.compute_dtype
        self.hardware, self.precision, self.kernel, self.world = hardware, precision, kernel, world
        self.gpus_per_node = hardware.gpus_per_node
        cpu = hardware.cpu
        self.compute_scale = cpu.compute_scale(world) if cpu else 1.0
        self.cpu_threads = cpu.threads(world) if cpu else 0
        self.op_seconds = cpu.op_overhead_us * 1e-6 * cpu.host_scale(world) if cpu else 0.0
        # a CPU profile's bandwidth is a measured copy: what its memory-bound ops reach
        efficiency = 1.0 if cpu else MEMORY_EFFICIENCY
        self.memory_bytes_per_s = hardware.hbm_tb_s * 1e12 * efficiency * self.compute_scale
        self.adamw_bytes = cpu.adamw_bytes if cpu and cpu.adamw_bytes else None  # None: the fused kernel's count
        self.call_latency_s = hardware.collective_latency_us * 1e-6
        self._links = {spans: (gb_s * 1e9 * efficiency, latency * 1e-6) for spans, gb_s, efficiency, latency in (
            (False, hardware.nvlink_gb_s, hardware.nvlink_efficiency, hardware.nvlink_latency_us),
            (True, hardware.net_gb_s, hardware.net_efficiency, hardware.net_latency_us))}
        if cpu:  # one machine: every group at gloo's rates for this many busy ranks
            gb_s, step_us, call_us = cpu.link_at(world)
            self.call_latency_s = call_us * 1e-6
            self._links = {spans: (gb_s * 1e9, step_us * 1e-6) for spans in (False, True)}
        self._matmul_peak = {dtype: hardware.peak_tflops(dtype) * 1e12 * self.compute_scale
                             for dtype in {precision, hardware.compute_dtype}}
        self._attention_peak = hardware.peak_tflops(hardware.compute_dtype) * 1e12 * self.compute_scale

    def at_world(self, world: int) -> DeviceRates:
        """These rates for one rank of ``world`` ranks (the same object on a GPU profile)."""
        if self.hardware.cpu is None or world == self.world:
            return self
        return DeviceRates(self.hardware, self.precision, self.kernel, world)

    def cp_call_seconds(self, algorithm: str, group: int, chunks: int) -> float:
        """A CPU profile's measured cost of one CP attention op call in a step (``CpuConstants.attention_call_us``
        alone, plus ``attention_in_step_us``)."""
        cpu = self.hardware.cpu
        if cpu is None:
            return 0.0
        return (cpu.attention_call_us(algorithm, self.world, group, chunks)
                + cpu.attention_in_step_us(algorithm, self.world, group)) * 1e-6

    def cp_byte_seconds(self, algorithm: str, group: int, size: float) -> float:
        """A CPU profile's measured cost of a CP attention op call beyond its negligible size, for ``size`` bytes of
        q, k, v and output (``CpuConstants.attention_byte_us``; 0 on a GPU)."""
        cpu = self.hardware.cpu
        return cpu.attention_byte_us(algorithm, self.world, group) * 1e-6 * size / 2**20 if cpu else 0.0

    def fsdp_unit_seconds(self) -> float | None:
        """A CPU profile's measured FSDP cost per unit and micro-batch at this world size (measured with the whole
        world sharding, the ranks sharing the cores as here; None: not measured, or a GPU)."""
        cpu = self.hardware.cpu
        us = cpu.fsdp_unit_us(self.world) if cpu else None
        return None if us is None else us * 1e-6

    def matmul(self, m: int, n: int, k: int, precision: str | None = None) -> float:
        precision = precision or self.precision
        cpu = self.hardware.cpu
        if cpu is not None and cpu.linears:  # a CPU's rate depends on the shape, not only the FLOPs
            return self._matmul_peak[precision] * cpu.linear_fraction(
                m, k, n, lambda flops: self.hardware.gemm_fraction(flops, precision))
        return self._matmul_peak[precision] * self.hardware.gemm_fraction(2.0 * m * n * k, precision)

    def attention(self, call: KernelCall, head_dim: int) -> float:
        side = math.sqrt(call.rows * call.keys)
        return self._attention_peak * self.hardware.attention_fraction(head_dim, side, call.causal, self.kernel)

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        return self._links[spans_nodes]

    def kind_link(self, kind: str, spans_nodes: bool) -> tuple[tuple[float, float], float]:
        """``((bytes/s, step latency s), call latency s)`` of a ``kind`` collective: a CPU profile's fit for that kind
        at this world size where it has one (``collective_kinds``), else ``link`` and the call latency."""
        cpu = self.hardware.cpu
        fitted = cpu.kind_link_at(kind, self.world) if cpu else None
        if fitted is None:
            return self.link(spans_nodes), self.call_latency_s
        gb_s, step_us, call_us = fitted
        return (gb_s * 1e9, step_us * 1e-6), call_us * 1e-6
