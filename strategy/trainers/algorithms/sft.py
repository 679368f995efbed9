"""Supervised fine-tuning: causal-LM loss on response tokens only, every response token of a
step weighing the same; optionally tiled over the vocabulary (``--tiled_logits_loss``)."""

from __future__ import annotations

import torch

from strategy.trainers.data import SFT
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import IGNORE, forward_inputs, response_loss, tiled_loss_sum
from strategy.trainers.losses.lm import TILE_VOCAB

__all__ = ["SFTTrainer", "response_loss", "response_tokens"]

def response_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal LM is scored on: labels after the first position that are not -100."""
    return int((labels[:, 1:] != IGNORE).sum())


class SFTTrainer(Trainer):
    """Causal LM on (prompt, response) or chat samples from ``data.load_sft`` (optionally
    packed)."""

    data = SFT
    command = "sft"
    _router_loss = None  # the MoE router loss of the last forward (with --aux_loss_coef)

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"tokens": response_tokens(batch["labels"])}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        metrics = {"response_tokens": self.micro_counts["tokens"]}  # of the whole batch
        loss = self.normalize(self.loss_sum(batch), "tokens")
        if self._router_loss is not None:  # MoE load balancing, a mean per micro-batch
            metrics["aux_loss"] = self._router_loss.item()
            loss = loss + self.cfg.aux_loss_coef * self._router_loss
        return loss, metrics

    @property
    def tiled(self) -> bool:
        """Tiled when asked, or automatically for vocabularies of TILE_VOCAB and more; the same
        on every rank (they must call the output layer alike)."""
        if self.cfg.tiled_logits_loss is not None:
            return self.cfg.tiled_logits_loss
        return self.model.module.config.get_text_config().vocab_size >= TILE_VOCAB

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Next-token cross-entropy summed over the scored tokens of this micro-batch (of this
        rank's sequence slice under sequence parallelism).

        Args:
            batch: one micro-batch on the device.

        Returns:
            The summed loss (a scalar tensor; ``normalize`` divides it).
        """
        self._router_loss = None
        if self.tiled:
            length = batch["input_ids"].numel()
            most = int(self.strategy.all_reduce(length, op="max"))
            return tiled_loss_sum(self.model, batch, self.cfg.logits_chunk_size, most)
        inputs = forward_inputs(batch)
        if "shift_labels" in batch:  # a sequence-parallel slice: its targets are shifted already
            inputs.update(labels=batch["shift_labels"], shift_labels=batch["shift_labels"])
        else:  # the model's own loss shifts the labels, not the logits (no copy of the largest)
            inputs["labels"] = batch["labels"]
        out = self.model(**inputs, num_items_in_batch=1)
        self._router_loss = out.aux_loss if self.cfg.aux_loss_coef > 0 else None
        return out.loss  # a sum (the router loss is added apart: router_aux_loss_coef is 0)
