"""Learning-rate schedules: transformers' ``get_scheduler`` with warmup by steps or ratio."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_steps(num_training_steps: int, num_warmup_steps: int | None, warmup_ratio: float | None) -> int:
    if num_warmup_steps is not None and warmup_ratio is not None:
        raise ValueError("give num_warmup_steps or warmup_ratio, not both")
    if num_warmup_steps is None:
        num_warmup_steps = math.ceil(num_training_steps * (warmup_ratio or 0.0))
    if not 0 <= num_warmup_steps <= num_training_steps:
        raise ValueError(f"num_warmup_steps={num_warmup_steps} is invalid: use 0..num_training_steps "
                         f"({num_training_steps})")
    return num_warmup_steps


def create_scheduler(optimizer: torch.optim.Optimizer, name: str = "cosine_with_min_lr", *,
                     num_training_steps: int, num_warmup_steps: int | None = None,
                     warmup_ratio: float | None = None, min_lr_ratio: float = 0.1) -> LambdaLR:
    """A per-optimizer-step schedule. ``cosine_with_min_lr`` decays to ``min_lr_ratio`` x peak."""
    from transformers import get_scheduler

    if num_training_steps < 1:
        raise ValueError(f"num_training_steps={num_training_steps} is invalid: use >= 1")
    warmup = warmup_steps(num_training_steps, num_warmup_steps, warmup_ratio)
    kwargs = {"min_lr_rate": min_lr_ratio} if name == "cosine_with_min_lr" else None
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=num_training_steps,
                         scheduler_specific_kwargs=kwargs)
