"""The one place that turns dataset size, batch sizes and epochs into optimizer steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps an epoch and the whole run take."""

    steps_per_epoch: int
    total_steps: int


def plan_steps(num_samples: int, train_batch_size: int, max_epochs: int,
               max_steps: int = -1) -> StepPlan:
    """Every optimizer step consumes ``train_batch_size`` samples; ``max_steps`` > 0 caps the
    run."""
    per_epoch = num_samples // train_batch_size
    total = per_epoch * max_epochs
    return StepPlan(per_epoch, min(total, max_steps) if max_steps > 0 else total)
