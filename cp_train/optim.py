"""AdamW, the warmup + decay learning-rate schedule (and its continuation on a resume), and clipping by the global
gradient norm."""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cp_train.config.schema import OptimizerConfig, ScheduleConfig
from cp_train.errors import InputError, one_line
from cp_train.model.shards import data_shards, local_tensor, tensor_parallel_dim


def build_optimizer(model: nn.Module, config: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``model``; no weight decay for 1-D parameters (norms, biases).

    ``config.implementation`` ``auto``, ``fused`` or ``foreach``: torch's AdamW with the kernels
    ``adamw_implementation`` resolves. ``apex``: ``apex.optimizers.FusedAdam(adam_w_mode=True)`` with the same
    groups and hyperparameters (``InputError`` naming ``optimizer.implementation`` when apex cannot be loaded); on the
    meta device (the dry run) torch's AdamW stands in for it, as both keep the same two moments per parameter.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    hyper = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps}
    if config.implementation == "apex" and device.type != "meta":
        return _apex_fused_adam(groups, hyper)
    flags = {"fused": True} if adamw_implementation(config, device.type) == "fused" else {"foreach": True}
    return torch.optim.AdamW(groups, **hyper, **flags)


def adamw_implementation(config: OptimizerConfig, device_type: str) -> str:
    """torch's AdamW kernels for ``config.implementation`` on ``device_type``: ``auto`` is ``fused`` on CUDA and
    CPU (on CPU 6x faster than ``foreach`` at cpu-tiny's 3.1M parameters, one thread: 2.1 against 13.0 ms, and
    without foreach's temporary per parameter), ``foreach`` elsewhere."""
    if config.implementation in ("fused", "foreach"):
        return config.implementation
    return "fused" if device_type in ("cuda", "cpu") else "foreach"


def _apex_fused_adam(groups: list[dict[str, Any]], hyper: dict[str, Any]) -> torch.optim.Optimizer:
    """apex's ``FusedAdam`` in AdamW mode (decoupled weight decay, as torch's AdamW)."""
    try:
        fused_adam = importlib.import_module("apex.optimizers").FusedAdam
        return fused_adam(groups, **hyper, adam_w_mode=True, weight_decay=0.0)
    except (ImportError, AttributeError, RuntimeError) as error:
        reason = one_line(str(error)) or type(error).__name__
        raise InputError(f"optimizer.implementation is apex but apex's FusedAdam cannot be loaded ({reason}); install "
                         f"NVIDIA apex with its CUDA extensions or set optimizer.implementation to auto") from None


class LRSchedule:
    """Linear warmup from 0 to ``lr`` over ``warmup_steps``, then ``decay`` to ``min_lr``: ``cosine`` or ``linear``
    over ``decay_steps`` (default: the rest of the run), ``wsd`` (warmup-stable-decay: ``lr`` until the last
    ``decay_fraction`` of the steps after warmup, or the last ``decay_steps``, then linear to ``min_lr`` at the
    last step), or ``constant``. A pure function of the step index, unless a resume that changed
    ``train.steps`` re-planned it (``replan``: from step ``from_step`` at ``start_lr``, the same shape of decay to
    ``min_lr`` at the new last step; ``continue_schedule``)."""

    def __init__(self, optimizer_config: OptimizerConfig, config: ScheduleConfig, train_steps: int) -> None:
        self.lr, self.min_lr = optimizer_config.lr, optimizer_config.min_lr
        self.warmup, self.decay, self.train_steps = config.warmup_steps, config.decay, train_steps
        self.decay_fraction = getattr(config, "decay_fraction", 0.2)
        if self.decay == "wsd":
            self.decay_steps = config.decay_steps or self._wsd_steps(train_steps - self.warmup)
        else:
            self.decay_steps = config.decay_steps or max(1, train_steps - config.warmup_steps)
        self.replan: dict[str, float] | None = None

    def _wsd_steps(self, steps: int) -> int:
        return max(1, round(self.decay_fraction * steps))

    def _decay(self, start: float, progress: float) -> float:
        progress = min(1.0, max(0.0, progress))
        if self.decay in ("linear", "wsd"):
            return start - (start - self.min_lr) * progress
        return self.min_lr + 0.5 * (start - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def __call__(self, step: int) -> float:
        """The learning rate of 0-based step ``step`` (the ``step + 1``-th optimizer step)."""
        if self.replan is not None and step >= self.replan["from_step"]:
            return self._replanned(step)
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.decay == "constant":
            return self.lr
        if self.decay == "wsd":
            stable = self.train_steps - self.decay_steps
            return self.lr if step < stable else self._decay(self.lr, (step - stable + 1) / self.decay_steps)
        return self._decay(self.lr, (step - self.warmup) / self.decay_steps)

    def _replanned(self, step: int) -> float:
        assert self.replan is not None
        first, start, end = int(self.replan["from_step"]), self.replan["start_lr"], int(self.replan["end_step"])
        if self.decay == "constant":
            return start
        if self.decay == "wsd":
            window = self._wsd_steps(end - first)
            return start if step < end - window else self._decay(start, (step - (end - window) + 1) / window)
        return self._decay(start, (step - first) / max(1, end - 1 - first))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup, "decay": self.decay,
                "decay_steps": self.decay_steps, "decay_fraction": self.decay_fraction,
                "train_steps": self.train_steps, "replan": self.replan}


def saved_schedule(saved_config: dict[str, Any], saved_state: dict[str, Any]) -> LRSchedule:
    """The schedule a checkpoint trained with: from its saved config, and its re-planned decay if any."""
    def made(kind: type, values: dict[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(kind)}
        return kind(**{k: v for k, v in values.items() if k in names})

    schedule = LRSchedule(made(OptimizerConfig, saved_config["optimizer"]),
                          made(ScheduleConfig, saved_config["schedule"]), saved_config["train"]["steps"])
    schedule.replan = saved_state.get("replan")
    return schedule


def continue_schedule(schedule: LRSchedule, saved: LRSchedule, step: int, restart: bool) -> str | None:
    """Make ``schedule`` (this run's, resumed after ``step`` steps) continue ``saved`` (the checkpoint's); the
    note to log. Unchanged ``train.steps``: a re-planned decay of the checkpoint goes on. Changed: where this run's
    plain schedule would move the LR away from that of the last step trained, the decay is re-planned from that
    LR to ``min_lr`` at the new last step (``restart``: the plain schedule instead, as ``--restart-schedule``
    asks; also when ``optimizer.lr``, ``min_lr`` or the schedule's settings changed: the new ones are followed)."""
    changed = saved.train_steps != schedule.train_steps

    def settings(s: LRSchedule) -> tuple:
        return s.lr, s.min_lr, s.warmup, s.decay, s.decay_fraction

    why = "--restart-schedule" if restart else None
    if settings(saved) != settings(schedule):  # the user asked for another schedule: it is followed
        why = "optimizer.lr, optimizer.min_lr or the schedule's settings changed"
    if why is None and not changed:
        schedule.replan = saved.replan
    fresh, before, next_saved = schedule(step), saved(step - 1), saved(step)  # before: the last step trained's LR
    if abs(fresh - next_saved) <= 0.01 * abs(next_saved):  # the LR the checkpoint's schedule gives the next step
        return None  # (an unchanged schedule, or a plain one that continues it: wsd while stable, say)
    old_end, new_end = saved.train_steps, schedule.train_steps
    if why is not None or not changed:
        return (f"LR schedule restarted ({why or 'the schedule changed'}): lr {before:.2e} -> {fresh:.2e} at step "
                f"{step + 1}")
    schedule.replan = {"from_step": step, "start_lr": before, "end_step": new_end}
    return (f"train.steps {old_end} -> {new_end}: LR schedule re-planned from step {step} (a restart would jump to "
            f"{fresh:.2e}; --restart-schedule does that): lr {saved(step - 1):.2e} -> {schedule(step):.2e} at steps "
            f"{step} -> {step + 1}, end lr {saved(old_end - 1):.2e} -> {schedule(new_end - 1):.2e} at steps "
            f"{old_end} -> {new_end} ({schedule.decay})")


def global_grad_norm(parameters: list[nn.Parameter], tp_group: dist.ProcessGroup | None,
                     data_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm of all gradients of the model (fp32 scalar, the same on every rank).

    Call after the DP x CP reduction. A gradient that is a sharded DTensor (FSDP) holds this rank's part of
    the sum, disjoint from the other ranks' of ``data_group`` (DP x CP): its squares are summed over that
    group; plain gradients are the whole sum, the same on every rank of the group, and counted once. Then
    TP-sharded parameters (``tensor_model_parallel``) are summed over ``tp_group``, replicated ones counted once.
    """
    return _global_norm([(param, param.grad) for param in parameters if param.grad is not None], tp_group,
                        data_group)


@torch.no_grad()
def global_param_norm(parameters: list[nn.Parameter], tp_group: dist.ProcessGroup | None,
                      data_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm of the parameters themselves (Megatron-LM's params norm; fp32, the same on every rank): FSDP's
    shards summed over ``data_group``, TP's over ``tp_group``, as ``global_grad_norm`` does."""
    return _global_norm([(param, param) for param in parameters], tp_group, data_group)


def _global_norm(pairs: list[tuple[nn.Parameter, torch.Tensor]], tp_group: dist.ProcessGroup | None,
                 data_group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm of the tensors of ``pairs`` ((parameter, its gradient or itself)) over every rank."""
    found: dict[tuple[bool, bool], list[torch.Tensor]] = {}  # (TP-sharded, sharded over data) -> local tensors
    for param, tensor in pairs:
        key = (tensor_parallel_dim(param) is not None, bool(data_shards(tensor)))
        found.setdefault(key, []).append(local_tensor(tensor))
    device = next(t for group in found.values() for t in group).device

    def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack(torch._foreach_norm([t.float() for t in tensors])).square().sum()

    # [tp-sharded, replicated over tp] x [sharded over data, whole]
    sums = torch.stack([sum_of_squares(found.get((tp, data), [])) for tp in (True, False) for data in (True, False)])
    sharded_over_data = sums[0::2].contiguous()
    if data_group is not None and dist.get_world_size(data_group) > 1 and any(data for _, data in found):
        dist.all_reduce(sharded_over_data, group=data_group)
    tp_sharded, replicated = sharded_over_data + sums[1::2]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(tp_sharded, group=tp_group)
    return (tp_sharded + replicated).sqrt()


def clip_gradients(parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` (``max_norm`` 0: off).

    The coefficient is computed on ``total_norm``'s device (fp64, then the gradients' dtype) and multiplied
    in unconditionally, so nothing is read to the host; a factor of exactly 1 leaves a gradient bitwise
    unchanged. A non-finite ``total_norm`` gives a NaN factor (the caller must stop the run)."""
    if max_norm <= 0:
        return
    norm = total_norm.detach().double()
    coefficient = torch.clamp(torch.full_like(norm, max_norm) / (norm + 1e-6), max=1.0)  # as Python's division
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            grad = local_tensor(param.grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, grads in by_dtype.items():
        torch._foreach_mul_(grads, coefficient.to(dtype))
