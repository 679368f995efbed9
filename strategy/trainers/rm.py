"""Reward model: pairwise loss -logsigmoid(r_chosen - r_rejected) on a scalar head, every pair of
a step weighing the same."""

from __future__ import annotations

import torch

from strategy.trainers.loop import Trainer
from strategy.trainers.losses import pairwise_losses, pairwise_metrics

__all__ = ["RewardModelTrainer", "pairwise_metrics"]


class RewardModelTrainer(Trainer):
    """``AutoModelForSequenceClassification(num_labels=1)`` on pairs collated
    chosen-then-rejected."""

    def rewards(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.model(input_ids=batch["input_ids"],
                            attention_mask=batch["attention_mask"]).logits[:, 0]
        half = scores.shape[0] // 2
        return scores[:half].float(), scores[half:].float()

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"pairs": int(batch["input_ids"].shape[0]) // 2}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.rewards(batch)
        losses, metrics = pairwise_losses(chosen, rejected)
        return self.normalize(losses.sum(), "pairs"), metrics
