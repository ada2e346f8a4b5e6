"""A hardware profile (``hardware.py``) as the rates the time model (``time_model.py``) asks for."""

from __future__ import annotations

import math

from cp_train.perf.inputs.hardware import Hardware
from cp_train.perf.workload import KernelCall

# memory-bound kernels (norms, adds, SwiGLU, AdamW) reach about this fraction of the HBM bandwidth: a STREAM
# copy on H100 SXM reaches ~3.0 of 3.35 TB/s (stas00/ml-engineering compute/accelerator/README.md, memory
# bandwidth table; NVIDIA's own nvbandwidth device-local copy figures agree within a few percent)
MEMORY_EFFICIENCY = 0.85


def linear_precision(fp8: str) -> str:
    """The linears' precision the planner plans for the trainer's ``model.fp8`` (one switch): fp8 unless none."""
    return "bf16" if fp8 == "none" else "fp8"


class DeviceRates:
    """``hardware``'s rates with linears in ``precision`` (bf16, or fp8 for fp8 linears; attention stays bf16) and
    attention by ``kernel`` (default: the profile's, the trainer's choice on that GPU); the varlen calls of packed
    documents by the profile's ``varlen_kernel`` (default: ``kernel``). ``cudnn_ragged`` runs the documents' causal
    squares as dense cuDNN calls (the profile's ``cudnn`` curves) and their full pieces, at cp > 1, on the varlen
    kernel (``AttentionSpec.rectangles``)."""

    def __init__(self, hardware: Hardware, precision: str = "bf16", kernel: str | None = None) -> None:
        self.ragged = kernel == "cudnn_ragged"
        kernel = "cudnn" if self.ragged else kernel or hardware.attention_kernel
        varlen_kernel = hardware.varlen_kernel or kernel
        for name in {kernel, varlen_kernel}:  # an unknown kernel: one line naming the known ones
            hardware.attention_fraction(128, 1024.0, True, name)
        self.hardware, self.precision, self.kernel, self.varlen_kernel = hardware, precision, kernel, varlen_kernel
        self.gpus_per_node = hardware.gpus_per_node
        self.memory_bytes_per_s = hardware.hbm_tb_s * 1e12 * MEMORY_EFFICIENCY
        self.call_latency_s = hardware.collective_latency_us * 1e-6
        self.pcie_bytes_per_s = hardware.pcie_gb_s * 1e9  # per direction (activation offload)
        self._links = {spans: (gb_s * 1e9 * efficiency, latency * 1e-6) for spans, gb_s, efficiency, latency in (
            (False, hardware.nvlink_gb_s, hardware.nvlink_efficiency, hardware.nvlink_latency_us),
            (True, hardware.net_gb_s, hardware.net_efficiency, hardware.net_latency_us))}
        self._matmul_peak = {dtype: hardware.peak_tflops(dtype) * 1e12 for dtype in {precision, "bf16"}}

    def matmul(self, m: int, n: int, k: int, precision: str | None = None) -> float:
        """FLOP/s of a ``[m, k] @ [k, n]`` matmul in ``precision`` (default: the run's linears')."""
        precision = precision or self.precision
        return self._matmul_peak[precision] * self.hardware.gemm_fraction(2.0 * m * n * k, precision)

    def attention(self, call: KernelCall, head_dim: int) -> float:
        """FLOP/s of one kernel call (forward and backward alike) at the square of its area's side, on the varlen
        kernel for a varlen call."""
        side = math.sqrt(call.rows * call.keys)
        kernel = self.varlen_kernel if call.varlen and not (self.ragged and call.causal) else self.kernel
        return self._matmul_peak["bf16"] * self.hardware.attention_fraction(head_dim, side, call.causal, kernel)

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """``(bytes/s per rank per direction, step latency s)`` inside a node or across nodes."""
        return self._links[spans_nodes]
