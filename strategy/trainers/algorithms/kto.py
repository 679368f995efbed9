"""Kahneman-Tversky optimization (Ethayarajh et al. 2024) on unpaired completions labelled
desirable or undesirable, against a frozen reference prepared by the same strategy.

The KL reference point ``z0`` is estimated as the paper does, from mismatched prompt/completion
pairs: the mean over a step's samples (every micro-batch, every rank) of the policy/reference
log-ratio of each sample's mismatched sequence (``data.unpaired``), clamped at 0 and detached. It
is computed before the step's forwards (one no-gradient pass of policy and reference, with dropout
off), so every micro-batch of the step uses the same value however the step is split; TRL instead
averages each device's micro-batch means. The loss is a mean over the step's samples (desirable
and undesirable alike, each with its weight), as TRL's. Held-out metrics use ``z0`` estimated over
the whole held-out set. Sequence parallelism and packing are refused.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from strategy.config import StrategyConfig
from strategy.errors import fail
from strategy.trainers.algorithms.preference import (
    check_reference_source,
    sequence_logps,
)
from strategy.trainers.config import DataConfig, KTOConfig
from strategy.trainers.data import UNPAIRED
from strategy.trainers.data.unpaired import check_first_row, mismatched
from strategy.trainers.loop import Step, Trainer
from strategy.trainers.loop.metrics import lockstep_batches
from strategy.trainers.losses import kto_losses

__all__ = ["KTOTrainer"]


class KTOTrainer(Trainer):
    """Policy trains on labelled completions; ``ref_model`` becomes an eval engine (ZeRO-3 sharded
    if training is ZeRO-3).

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy to train.
        ref_model: the frozen reference.
        optimizer: the policy's optimizer.
        scheduler: its learning-rate schedule.
        train_dataloader: the loader of ``UNPAIRED`` samples.
        eval_dataloader: held-out samples, or None.
        config: the ``TrainConfig``.
        tokenizer: saved with exports and checkpoints.
        kto: the ``KTOConfig`` (default: ``KTOConfig()``).
    """

    data = UNPAIRED
    command = "kto"
    config_classes = (KTOConfig,)

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        """Refuse what KTO cannot run, before any process group starts.

        Args:
            configs: the parsed configs by class.
            world_size: ranks the launcher started.

        Raises:
            ConfigError: sequence parallelism, packing or streaming; a reference it
                cannot build.
            DataError: the data's first row has no label (nor a preference pair).
        """
        check_reference_source(configs)
        sequence = configs[StrategyConfig].sequence_parallel_size
        if sequence > 1:
            fail("sequence_parallel_size", sequence, "KTO runs without sequence parallelism; "
                 "set 1")
        data = configs[DataConfig]
        for name in ("packing_samples", "pack_dataset", "streaming"):
            if getattr(data, name):
                fail(name, True, "KTO's mismatched KL pairs need the whole, unpacked dataset; "
                     "drop the flag")
        check_first_row(data)

    def __init__(self, strategy, model, ref_model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None,
                 kto: KTOConfig | None = None) -> None:
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader, eval_dataloader,
                         config, tokenizer)
        self.kto = kto or KTOConfig()
        self.ref_model = strategy.prepare(ref_model)
        self.kl = 0.0  # the KL reference point of the step (or evaluation) being run

    @torch.no_grad()
    def kl_estimate(self, batches: Iterable[tuple[dict, bool]]) -> float:
        """The KL reference point over ``(batch, real)`` micro-batches of every rank (collective;
        the batches of ``real`` False are run but not counted): mean policy/reference log-ratio
        of the mismatched sequences, clamped at 0, with the policy's dropout off.

        Args:
            batches: this rank's micro-batches, each with whether it counts.

        Returns:
            ``z0``, the same on every rank.
        """
        training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for batch, real in batches:
            kl = mismatched(self.to_device(batch))
            ratio = sequence_logps(self.model, kl).float() - sequence_logps(self.ref_model, kl)
            if real:
                total, count = total + float(ratio.sum()), count + ratio.numel()
        self.model.train(training)
        sums = self.strategy.all_reduce({"total": total, "count": count}, op="sum", group="data")
        return max(sums["total"] / max(sums["count"], 1), 0.0)

    def train_steps(self, epoch: int, count: int) -> Iterator[Step]:
        for step in super().train_steps(epoch, count):
            self.kl = self.kl_estimate((batch, True) for batch in step.batches)
            step.metrics["kl"] = (self.kl, 1.0)  # the same on every rank: its mean over ranks
            yield step

    def evaluate(self) -> dict:
        step_kl, self.kl = self.kl, self.kl_estimate(lockstep_batches(self.eval_dataloader))
        try:
            return super().evaluate()
        finally:
            self.kl = step_kl

    def eval_metrics(self, batch: dict) -> dict:
        return {**super().eval_metrics(batch), "kl": self.kl}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        policy = sequence_logps(self.model, batch).float()
        with torch.no_grad():
            ref = sequence_logps(self.ref_model, batch).float()
        cfg = self.kto
        losses, metrics = kto_losses(policy, ref, batch["desirable"], self.kl, cfg.kto_beta,
                                     cfg.desirable_weight, cfg.undesirable_weight)
        return self.normalize(losses.sum(), "samples"), metrics
