"""Reward model: pairwise loss -logsigmoid(r_chosen - r_rejected) on a scalar head, every pair of
a step weighing the same."""

from __future__ import annotations

import torch

from strategy.errors import fail
from strategy.model import base_model
from strategy.trainers.data import PAIRS
from strategy.trainers.data.packing import pair_count
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import forward_inputs, pairwise_losses, pairwise_metrics

__all__ = ["RewardModelTrainer", "pairwise_metrics"]


def packed_scores(model, batch: dict) -> torch.Tensor:
    """Each packed sample's score, from the backbone's hidden state at its own last token (the
    model's pooled output would take one token per row)."""
    model = base_model(model)
    states = getattr(model, model.base_model_prefix)(**forward_inputs(batch)).last_hidden_state
    picked = states.reshape(-1, states.shape[-1])[batch["last_token"]]
    return model.score(picked)[:, 0]


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

    def __init__(self, strategy, *args, **kwargs) -> None:
        if strategy.config.sequence_parallel_size > 1:
            fail("sequence_parallel_size", strategy.config.sequence_parallel_size, "a reward "
                 "model scores each sequence's last token, which one slice holds; train it "
                 "without sequence parallelism")
        super().__init__(strategy, *args, **kwargs)

    def rewards(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores; packed rows score each sample at its own last token.

        Args:
            batch: a pair micro-batch on the device, chosen rows (or samples) first.

        Returns:
            ``(chosen, rejected)`` float32 scores, one per pair each.
        """
        if "last_token" in batch:
            scores = packed_scores(self.model.module, batch)
        else:
            scores = self.model(**forward_inputs(batch)).logits[:, 0]
        half = scores.shape[0] // 2
        return scores[:half].float(), scores[half:].float()

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"pairs": pair_count(batch)}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.rewards(batch)
        losses, metrics = pairwise_losses(chosen, rejected)
        return self.normalize(losses.sum(), "pairs"), metrics
