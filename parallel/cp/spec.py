"""How one context-parallel attention call site runs, decided once: the frozen ``AttentionSpec``.

The algorithms it names are in ``algorithms.py``; the groups it runs on are ``CPGroups``
(``cp_train.parallel.mesh.groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cp_train.parallel.kernels.select import AttentionKernel


@dataclass(frozen=True)
class AttentionSpec:
    """One call site's settings, decided once: ``algorithm``, CP ``layout``, ``causal``, softmax ``scale``,
    the ``kernel``, the kv-head ``head_chunks`` (the ring's backward and the all-gather), the ring backward's
    ``overlap`` policy, whether steps of many segments run as ``varlen`` calls (``parallel/ring_core.py``)
    and the ring forward's ``forward_head_chunks``.

    The ring's forward runs in one head chunk unless asked otherwise: chunks bound the K/V it receives,
    but a training step's backward holds dq, dk and dv whole, which is at least that, and an eval forward
    keeps no activations, so chunking the forward lowers no peak and costs a copy and a kernel call per chunk
    (3-5% of the forward on CPU at cp=2)."""

    algorithm: str
    layout: str
    causal: bool
    scale: float
    kernel: AttentionKernel
    head_chunks: int
    overlap: bool
    varlen: bool = False
    forward_head_chunks: int = 1
