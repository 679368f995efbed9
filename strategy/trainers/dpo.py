"""Direct preference optimization against a frozen reference prepared by the same strategy.

The DPO term weighs every pair of a step the same; the optional NLL term on the chosen responses
weighs every chosen token the same."""

from __future__ import annotations

import torch

from strategy.trainers.config import DPOConfig
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import IGNORE, dpo_loss, dpo_losses, log_softmax_gather

__all__ = ["DPOTrainer", "dpo_loss", "sequence_logps"]


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed log-probability of each row's response tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp, _ = log_softmax_gather(logits, batch["labels"])
    return logp.sum(-1)


class DPOTrainer(Trainer):
    """Policy trains; ``ref_model`` becomes an eval engine (ZeRO-3 sharded if training is
    ZeRO-3)."""

    def __init__(self, strategy, model, ref_model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None,
                 dpo: DPOConfig | None = None) -> None:
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader, eval_dataloader,
                         config, tokenizer)
        self.dpo = dpo or DPOConfig()
        self.ref_model = strategy.prepare(ref_model)

    def loss_counts(self, batch: dict) -> dict[str, int]:
        half = int(batch["input_ids"].shape[0]) // 2
        return {"pairs": half, "chosen_tokens": int((batch["labels"][:half, 1:] != IGNORE).sum())}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        logps = sequence_logps(self.model, batch).float()
        with torch.no_grad():
            ref = sequence_logps(self.ref_model, batch).float()
        half = logps.shape[0] // 2
        losses, metrics = dpo_losses(logps[:half], logps[half:], ref[:half], ref[half:],
                                     self.dpo.beta, self.dpo.label_smoothing)
        loss = self.normalize(losses.sum(), "pairs")
        if self.dpo.nll_loss_coef > 0:
            nll = self.normalize(-logps[:half].sum(), "chosen_tokens")
            loss = loss + self.dpo.nll_loss_coef * nll
        return loss, metrics
