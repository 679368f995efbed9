"""Reward model: pairwise loss -logsigmoid(r_chosen - r_rejected) on a scalar head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strategy.trainers.base import Trainer


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The Bradley-Terry loss and how often the chosen response scores higher."""
    loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, {"accuracy": (chosen > rejected).float().mean().item(),
                  "reward_margin": (chosen - rejected).mean().item()}


class RewardModelTrainer(Trainer):
    """``AutoModelForSequenceClassification(num_labels=1)`` on pairs collated chosen-then-rejected."""

    def rewards(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        half = scores.shape[0] // 2
        return scores[:half].float(), scores[half:].float()

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        return pairwise_metrics(*self.rewards(batch))
