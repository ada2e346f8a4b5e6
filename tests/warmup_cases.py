"""Spawned-rank cases for the ring's warm-up of per-shape kernel plans (``parallel/cp/ring/warm.py``): the CPU
flash kernel counted as a GPU kernel (varlen calls of its own, run here segment by segment and not recorded, and a
plan per dense shape), its dense calls' keys recorded per step."""

from __future__ import annotations

from bench.cudnn_graphs import DenseKeys, lognormal_documents
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from tests.document_cases import inputs, run_documents


def new_keys_by_step(algorithm: str, layout: str, seqlen: int, steps: int, warmed: bool, median: int
                     ) -> list[int]:
    """The dense keys first seen at each of ``steps`` forward + backward passes of ``algorithm`` on a new sample of
    lognormal documents (``median`` tokens) each, one sample per micro-batch and two kv-head chunks as the GPU
    configs train (the CPU's default chunks follow the documents), with the warm-up on or off, in a thread that
    warmed nothing before (this rank's; index 0 unused)."""
    keys = DenseKeys()
    warm.forget()
    q, k, v, dout = (x[:1] for x in inputs(seqlen, 4, 2, seed=1))
    TorchCpuFlash.plans_per_shape, TorchCpuFlash.native_varlen, warm.ENABLED = True, True, warmed
    try:
        with keys.recording(TorchCpuFlash):
            for step in range(1, steps + 1):
                keys.step = step
                docs = lognormal_documents(seqlen, 1, seed=step, median=median)
                run_documents(q, k, v, dout, docs, layout, True, head_chunks=2, algorithm=algorithm)
    finally:
        del TorchCpuFlash.plans_per_shape
        del TorchCpuFlash.native_varlen
        warm.ENABLED = True
    return keys.new_by_step(steps)
