"""Reward model: pairwise loss -logsigmoid(r_chosen - r_rejected) on a scalar head."""

from __future__ import annotations

import torch

from strategy.trainers.loop import Trainer
from strategy.trainers.losses import pairwise_metrics

__all__ = ["RewardModelTrainer", "pairwise_metrics"]


class RewardModelTrainer(Trainer):
    """``AutoModelForSequenceClassification(num_labels=1)`` on pairs collated
    chosen-then-rejected."""

    def rewards(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.model(input_ids=batch["input_ids"],
                            attention_mask=batch["attention_mask"]).logits[:, 0]
        half = scores.shape[0] // 2
        return scores[:half].float(), scores[half:].float()

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        return pairwise_metrics(*self.rewards(batch))
