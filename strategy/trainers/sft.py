"""Supervised fine-tuning: causal-LM loss on response tokens only."""

from __future__ import annotations

import torch

from strategy.trainers.loop import Trainer
from strategy.trainers.losses import IGNORE, response_loss

__all__ = ["SFTTrainer", "response_loss"]


class SFTTrainer(Trainer):
    """Causal LM on (prompt, response) samples from ``data.load_sft`` (optionally packed)."""

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        # the model's own loss shifts the labels, not the logits (no copy of the largest tensor);
        # it equals response_loss: the mean over tokens whose label is not -100
        keys = ("input_ids", "attention_mask", "position_ids", "labels")
        kwargs = {k: batch[k] for k in keys if k in batch}
        tokens = int((batch["labels"][:, 1:] != IGNORE).sum())
        return self.model(**kwargs).loss, {"response_tokens": tokens}
