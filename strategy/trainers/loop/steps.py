"""The one place that turns dataset size, batch sizes and epochs into optimizer steps.

Rule for leftovers: an epoch runs a whole number of optimizer steps. Each data-parallel rank gets
``samples // dp`` samples, cut into ``micro`` sized batches (a partial last batch is dropped), and
``accumulation`` of those make a step; micro-batches left at the end of an epoch (fewer than a
step's worth) are dropped too, and the next epoch's shuffle puts other samples there. Nested floor
divisions make this exactly ``samples // train_batch_size`` steps per epoch. The schedule, the
progress bar, resume and ``steps_per_epoch`` all use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps an epoch and the whole run take."""

    steps_per_epoch: int
    total_steps: int


def plan_steps(num_samples: int | None, train_batch_size: int, max_epochs: int,
               max_steps: int = -1) -> StepPlan:
    """``max_steps`` > 0 caps the run; a stream (``num_samples`` None) runs ``max_steps`` in one
    go."""
    if num_samples is None:
        return StepPlan(max_steps, max_steps)
    per_epoch = num_samples // train_batch_size
    total = per_epoch * max_epochs
    return StepPlan(per_epoch, min(total, max_steps) if max_steps > 0 else total)


def sample_count(loader) -> int | None:
    """Samples in a loader's dataset; None for a stream (no length)."""
    try:
        return len(loader.dataset)
    except TypeError:
        return None
