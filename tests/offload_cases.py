"""Rank-side runs of activation offload (``model.activation_offload``) on the tiny trainer run, for
``tests/model/test_offload.py``.

Called as ``run_with_parallel((tp, cp, dp), offload_against_none, ...)`` on every rank of a spawned gloo world:
each case trains two steps with the offload off and on, from the same seed and batches.
"""

from __future__ import annotations

from typing import Any

from cp_train.parallel import offload
from cp_train.parallel.mesh.state import ParallelState
from tests import trainer_cases

STEPS = 1
LAYERS = 3  # the tiny model with a third block: one offloaded layer prefetched while another runs its backward


def offload_against_none(state: ParallelState, prefix: str, run_dir: str, cases: dict[str, dict[str, Any]]
                         ) -> dict[str, dict[str, Any]]:
    """Per case (dotted overrides with ``model.activation_offload``): whether the losses of ``STEPS`` steps and the
    first step's full gradients (their digest) are bitwise those of the same run without offload, and the offload's
    counts summed over the run's forwards (every tensor over 0 bytes offloaded: ``MIN_OFFLOAD_BYTES`` 0)."""
    smallest = offload.MIN_OFFLOAD_BYTES
    offload.MIN_OFFLOAD_BYTES = 0  # the tiny model's tensors are a few KiB: offload them all
    try:
        out = {}
        for name, overrides in cases.items():
            runs, stats = {}, []
            for mode in ("none", overrides["model.activation_offload"]):
                with offload.observe() as seen:
                    runs[mode] = trainer_cases.train_layout(
                        state, prefix, f"{run_dir}/{name}-{mode}",
                        {"model.num_layers": LAYERS, "data.cache_dir": f"{run_dir}/index-cache", **overrides,
                         "model.activation_offload": mode}, until_step=STEPS)
                stats = seen if mode != "none" else stats
            off, on = runs["none"], runs[overrides["model.activation_offload"]]
            out[name] = {"losses": on["losses"], "same_losses": on["losses"] == off["losses"],
                         "same_grads": on["grad_digest"] == off["grad_digest"], "forwards": len(stats),
                         "offloaded": sum(s.offloaded for s in stats), "fetched": sum(s.fetched for s in stats),
                         "host_bytes": sum(s.host_bytes for s in stats),
                         "fetched_late": sum(s.fetched_late for s in stats),
                         "peak_layers": max((s.peak_layers for s in stats), default=0)}
        return out
    finally:
        offload.MIN_OFFLOAD_BYTES = smallest
