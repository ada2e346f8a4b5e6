"""A batch's CP plans per attention window, made where the batch is made (the data loader's collate).

A model that mixes full and sliding-window layers needs one plan per distinct window. Made in the loader's
workers from every CP rank's document ids (``SamplePlanner``, no communication), they reach the step as one
``LayerPlans`` under the micro-batch's plan key: moved to the device with the batch, so the forward neither
gathers document ids nor copies anything from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_train.parallel.cp.plan.batch_plan import CPPlan, SamplePlanner


@dataclass(frozen=True)
class LayerPlans:
    """``full``: the plan of the full-attention layers; ``windows``: ``{W: plan}`` of each sliding window. What
    the trainer reads of a batch's plan (``areas``, ``pairs``) is the full layers'."""

    full: CPPlan
    windows: dict[int, CPPlan]

    @property
    def areas(self) -> list[int]:
        return self.full.areas

    @property
    def pairs(self) -> int:
        return self.full.pairs

    def by_window(self) -> dict[int | None, CPPlan]:
        """``{None: full, W: plan, ...}``: ``GPTModel.layer_plans``' form."""
        return {None: self.full, **self.windows}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LayerPlans:
        return LayerPlans(self.full.to(device, non_blocking),
                          {w: p.to(device, non_blocking) for w, p in self.windows.items()})

    def pin_memory(self) -> LayerPlans:
        return LayerPlans(self.full.pin_memory(), {w: p.pin_memory() for w, p in self.windows.items()})


@dataclass(frozen=True)
class LayerSamplePlanner:
    """``SamplePlanner`` for a model with sliding windows: ``full`` and one planner per window, the same call."""

    full: SamplePlanner
    windows: dict[int, SamplePlanner]

    def __call__(self, docs: torch.Tensor, positions: torch.Tensor) -> LayerPlans:
        return LayerPlans(self.full(docs, positions), {w: p(docs, positions) for w, p in self.windows.items()})
