"""Reward model: pairwise loss -logsigmoid(r_chosen - r_rejected) on a scalar head, every pair of
a step weighing the same. Each sequence is scored at its last attended token, the EOS that ends
prompt + response (``losses.sequence_scores``), packed or not, whatever the pad token."""

from __future__ import annotations

import torch

from strategy.config import StrategyConfig
from strategy.errors import fail
from strategy.trainers.config import RewardConfig
from strategy.trainers.data import PAIRS
from strategy.trainers.data.packing import pair_count
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import pairwise_losses, pairwise_metrics, sequence_scores

__all__ = ["RewardModelTrainer", "pairwise_metrics"]


def _refuse_sequence_parallel(size: int) -> None:
    if size > 1:
        fail("sequence_parallel_size", size, "a reward model scores each sequence's last token, "
             "which one slice holds; train it without sequence parallelism")


class RewardModelTrainer(Trainer):
    """``AutoModelForSequenceClassification(num_labels=1)`` on pairs collated
    chosen-then-rejected.

    Args:
        strategy: the ``DeepSpeedStrategy`` (without sequence parallelism).
        *args: the rest of ``Trainer``'s arguments (model, optimizer, scheduler, loaders...).
        **kwargs: the same, by keyword.

    Raises:
        ConfigError: ``sequence_parallel_size`` > 1.
    """

    data = PAIRS
    command = "rm"
    config_classes = (RewardConfig,)  # --loss, as OpenRLHF's RM spells it

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        """A reward model cannot train under sequence parallelism.

        Args:
            configs: the parsed configs by class.
            world_size: ranks the launcher started.

        Raises:
            ConfigError: ``sequence_parallel_size`` > 1.
        """
        _refuse_sequence_parallel(configs[StrategyConfig].sequence_parallel_size)

    def __init__(self, strategy, *args, **kwargs) -> None:
        _refuse_sequence_parallel(strategy.config.sequence_parallel_size)
        super().__init__(strategy, *args, **kwargs)

    def rewards(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores, each at its sequence's last attended token (packed: each
        sample's own last token).

        Args:
            batch: a pair micro-batch on the device, chosen rows (or samples) first.

        Returns:
            ``(chosen, rejected)`` float32 scores, one per pair each.
        """
        scores = sequence_scores(self.model.module, batch)
        half = scores.shape[0] // 2
        return scores[:half].float(), scores[half:].float()

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"pairs": pair_count(batch)}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.rewards(batch)
        losses, metrics = pairwise_losses(chosen, rejected)
        return self.normalize(losses.sum(), "pairs"), metrics
