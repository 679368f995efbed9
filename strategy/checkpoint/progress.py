"""Where a run stands: optimizer steps, consumed samples, and the position in the data loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strategy.errors import fail
from strategy.internals import engine_counters


@dataclass
class ResumeState:
    """Where a resumed run stands; ``epoch_consumed`` goes to
    ``sampler.set_epoch(epoch, epoch_consumed)``.

    Attributes:
        tag: the checkpoint loaded.
        global_step: optimizer steps done.
        consumed_samples: global samples consumed by those steps.
        epoch: the sampler's epoch (None when no dataloader was given).
        epoch_consumed: global samples of that epoch already consumed (None likewise).
    """

    tag: str  # the checkpoint loaded
    global_step: int  # optimizer steps done
    consumed_samples: int  # global samples consumed by those steps
    epoch: int | None  # the sampler's epoch (None when no dataloader was given at save)
    epoch_consumed: int | None  # global samples of that epoch already consumed


def sampler_of(dataloader: Any) -> Any:
    sampler = getattr(dataloader, "sampler", dataloader)
    if not hasattr(sampler, "load_state_dict") or not hasattr(sampler, "num_replicas"):
        fail("dataloader", type(sampler).__name__, "pass the loader from strategy.setup_dataloader "
             "(its ResumableDistributedSampler records the position)")
    return sampler


def progress(engine: Any, dataloader: Any = None, samples_per_step: int | None = None) -> dict:
    """Step, consumed samples and (with a loader) the sampler's epoch and position in it.

    Every optimizer step consumes ``train_batch_size`` samples and an epoch is a whole number of
    steps (micro-batches left over at its end are dropped, the rule ``trainers.steps`` states),
    so the position follows from the step count (epochs counted from 0). ``samples_per_step``:
    the run's global batch (DeepSpeed's own sample count counts every tensor-parallel rank).

    Args:
        engine: the DeepSpeed engine whose counters are read.
        dataloader: the run's loader (optional; without it ``epoch`` and ``epoch_consumed`` are
            None).
        samples_per_step: the global batch; None uses DeepSpeed's sample count.

    Returns:
        A dict of ``global_step``, ``consumed_samples``, ``epoch`` and ``epoch_consumed``.

    Raises:
        ConfigError: ``dataloader``'s sampler cannot record a position.
    """
    steps, samples, _ = engine_counters(engine)
    if samples_per_step is not None:
        samples = steps * samples_per_step
    out = {"global_step": steps, "consumed_samples": samples, "epoch": None, "epoch_consumed": None}
    if dataloader is not None:
        sampler = sampler_of(dataloader)
        batch = getattr(dataloader, "batch_size", None) or 1
        accumulation = engine.gradient_accumulation_steps()
        micro_batches = sampler.num_samples // batch
        per_epoch = micro_batches // accumulation * accumulation * batch * sampler.num_replicas
        out["epoch"], out["epoch_consumed"] = divmod(samples, max(per_epoch, 1))
    return out


def check_boundary(engine: Any) -> None:
    """A checkpoint holds no gradients: it must be taken right after an optimizer step."""
    accum = engine.gradient_accumulation_steps()
    micro = engine_counters(engine)[2]
    if micro % accum:
        fail("save_ckpt", f"micro step {micro % accum} of {accum}", "save right after "
             "optimizer_step at an accumulation boundary (the step's gradients are not saved)")
