"""Supervised fine-tuning: causal-LM loss on response tokens only."""

from __future__ import annotations

import torch

from strategy.trainers.base import Trainer


def response_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over tokens whose label is not -100 (prompt and padding)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    n = int((labels != -100).sum())
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss / max(n, 1), n


class SFTTrainer(Trainer):
    """Causal LM on (prompt, response) samples from ``datasets.load_sft`` (optionally packed)."""

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        # the model's own loss shifts the labels, not the logits (no copy of the largest tensor);
        # it equals response_loss: the mean over tokens whose label is not -100
        kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in batch}
        return self.model(**kwargs).loss, {"response_tokens": int((batch["labels"][:, 1:] != -100).sum())}
