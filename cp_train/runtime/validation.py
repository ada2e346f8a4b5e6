"""The validation loss of a training run: the mean token loss over the validation split, exact over DP x CP."""

from __future__ import annotations

from typing import Any

import torch

from cp_train.loss import masked_loss_sum, reduce_sums
from cp_train.model.parallelize import release_gathered
from cp_train.runtime.device_batches import loss_tokens

Trainer = Any  # the running ``cp_train.trainer.Trainer`` (not imported: it imports this module)


@torch.no_grad()
def validation_loss(trainer: Trainer) -> float:
    """Mean loss over the validation batches (collective over DP x CP), or NaN without a validation split. Steps
    not read yet are read first: a diverged model is not evaluated."""
    if trainer.valid_data is None:
        return float("nan")
    trainer.read_steps()
    loader = trainer.data.valid_loader(trainer.env)
    trainer.module.eval()
    local_sum, local_tokens = torch.zeros((), dtype=torch.float64, device=trainer.device), 0.0
    for micro_batches in loader:
        for mb in trainer._to_device(micro_batches):
            with trainer._autocast():
                token_losses, _ = trainer._losses(mb)
            local_sum += masked_loss_sum(token_losses, mb["loss_mask"]).double()
            local_tokens += loss_tokens(mb)
    trainer.module.train()
    release_gathered(trainer.model)  # the root and the last block stay gathered after a forward
    total, tokens = reduce_sums([local_sum, local_tokens], trainer.state.dp_cp.group, trainer.device)
    return total / max(tokens, 1.0)
