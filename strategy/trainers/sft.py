"""Supervised fine-tuning: causal-LM loss on response tokens only, every response token of a
step weighing the same."""

from __future__ import annotations

import torch

from strategy.trainers.loop import Trainer
from strategy.trainers.losses import IGNORE, response_loss

__all__ = ["SFTTrainer", "response_loss"]

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels")


def response_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal LM is scored on: labels after the first position that are not -100."""
    return int((labels[:, 1:] != IGNORE).sum())


class SFTTrainer(Trainer):
    """Causal LM on (prompt, response) or chat samples from ``data.load_sft`` (optionally
    packed)."""

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"tokens": response_tokens(batch["labels"])}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        # the model's own loss shifts the labels, not the logits (no copy of the largest tensor);
        # num_items_in_batch=1 makes it the sum over scored tokens, which normalize() divides
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        total = self.model(**inputs, num_items_in_batch=1).loss
        metrics = {"response_tokens": response_tokens(batch["labels"])}
        return self.normalize(total, "tokens"), metrics
