"""Learning-rate schedules: transformers' ``get_scheduler`` with warmup by steps or ratio, and
``CosineAnnealingWarmupLR`` (linear warmup to the peak, then cosine down to ``eta_min``)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from strategy.optim.config import COSINE_ANNEALING_WARMUP


class CosineAnnealingWarmupLR(LRScheduler):
    """ColossalAI's schedule. Step t < W: ``base * (t + 1) / W`` (the peak is reached at t = W - 1);
    t >= W: ``eta_min + (base - eta_min) * (1 + cos(pi * (t - W) / (T - W))) / 2``; t >= T stays at
    eta_min.

    Args:
        optimizer: the optimizer whose groups' lr it sets.
        total_steps: T, the optimizer steps of the whole run.
        warmup_steps: W, the steps of linear warmup.
        eta_min: the final learning rate.
        last_epoch: the last step taken; -1 starts fresh.

    Raises:
        ValueError: ``total_steps`` < 1, ``warmup_steps`` outside 0..T, or ``eta_min`` < 0.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 eta_min: float = 0.0, last_epoch: int = -1) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} is invalid: use >= 1")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps={warmup_steps} is invalid: "
                             f"use 0..total_steps ({total_steps})")
        if eta_min < 0:
            raise ValueError(f"eta_min={eta_min} is invalid: use a learning rate >= 0")
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        """The closed-form lr of step ``t`` (the value in effect for the t-th optimizer step).

        Args:
            base_lr: the group's peak learning rate.
            t: the step, from 0.

        Returns:
            The learning rate.
        """
        warmup, total = self.warmup_steps, self.total_steps
        if t < warmup:
            return base_lr * (t + 1) / warmup
        if t >= total:
            return self.eta_min
        cosine = math.cos(math.pi * (t - warmup) / (total - warmup))
        return self.eta_min + (base_lr - self.eta_min) * (1 + cosine) / 2

    def get_lr(self) -> list[float]:
        """The learning rates of the current step (torch's ``LRScheduler`` hook).

        Returns:
            One learning rate per parameter group.
        """
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]


def warmup_steps(num_training_steps: int, num_warmup_steps: int | None,
                 warmup_ratio: float | None) -> int:
    if num_warmup_steps is not None and warmup_ratio is not None:
        raise ValueError("give num_warmup_steps or warmup_ratio, not both")
    if num_warmup_steps is None:
        num_warmup_steps = math.ceil(num_training_steps * (warmup_ratio or 0.0))
    if not 0 <= num_warmup_steps <= num_training_steps:
        raise ValueError(f"num_warmup_steps={num_warmup_steps} is invalid: "
                         f"use 0..num_training_steps ({num_training_steps})")
    return num_warmup_steps


def create_scheduler(optimizer: torch.optim.Optimizer, name: str = "cosine_with_min_lr", *,
                     num_training_steps: int, num_warmup_steps: int | None = None,
                     warmup_ratio: float | None = None, min_lr_ratio: float = 0.1) -> LRScheduler:
    """A per-optimizer-step schedule. ``cosine_with_min_lr`` and ``cosine_annealing_warmup`` decay
    to ``min_lr_ratio`` x peak (the latter's eta_min is taken from the first group's lr).

    Args:
        optimizer: the optimizer to schedule.
        name: ``cosine_annealing_warmup`` or a transformers scheduler name.
        num_training_steps: optimizer steps of the whole run.
        num_warmup_steps: warmup steps; give this or ``warmup_ratio``, not both.
        warmup_ratio: warmup as a fraction of ``num_training_steps``.
        min_lr_ratio: final lr as a fraction of the peak (cosine schedules).

    Returns:
        The scheduler, to step once per optimizer step.

    Raises:
        ValueError: a step count is out of range, or both warmup arguments are given.
    """
    if num_training_steps < 1:
        raise ValueError(f"num_training_steps={num_training_steps} is invalid: use >= 1")
    warmup = warmup_steps(num_training_steps, num_warmup_steps, warmup_ratio)
    if name == COSINE_ANNEALING_WARMUP:
        peak = optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])
        return CosineAnnealingWarmupLR(optimizer, num_training_steps, warmup,
                                       eta_min=min_lr_ratio * peak)
    from transformers import get_scheduler  # its module loads peft and bitsandbytes (~1 s)

    kwargs = {"min_lr_rate": min_lr_ratio} if name == "cosine_with_min_lr" else None
    return get_scheduler(name, optimizer, num_warmup_steps=warmup,
                         num_training_steps=num_training_steps, scheduler_specific_kwargs=kwargs)
