"""Direct preference optimization against a frozen reference prepared by the same strategy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strategy.trainers.base import Trainer, log_softmax_gather


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed log-probability of each row's response tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp, _ = log_softmax_gather(logits, batch["labels"])
    return logp.sum(-1)


def dpo_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """DPO (conservative with ``label_smoothing``) from policy/reference log-probs of chosen/rejected."""
    logits = (pc - rc) - (pr - rr)
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    chosen_reward, rejected_reward = beta * (pc - rc).detach(), beta * (pr - rr).detach()
    return losses.mean(), {"reward_accuracy": (chosen_reward > rejected_reward).float().mean().item(),
                           "reward_margin": (chosen_reward - rejected_reward).mean().item(),
                           "chosen_reward": chosen_reward.mean().item(),
                           "rejected_reward": rejected_reward.mean().item()}


class DPOTrainer(Trainer):
    """Policy trains; ``ref_model`` becomes an eval engine (ZeRO-3 sharded if training is ZeRO-3)."""

    def __init__(self, strategy, model, ref_model, optimizer, scheduler, train_dataloader, eval_dataloader=None,
                 config=None, tokenizer=None) -> None:
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader, eval_dataloader, config, tokenizer)
        self.ref_model = strategy.prepare(ref_model)

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        logps = sequence_logps(self.model, batch).float()
        with torch.no_grad():
            ref = sequence_logps(self.ref_model, batch).float()
        half = logps.shape[0] // 2
        loss, metrics = dpo_loss(logps[:half], logps[half:], ref[:half], ref[half:], self.cfg.beta,
                                 self.cfg.label_smoothing)
        if self.cfg.nll_loss_coef > 0:
            n = (batch["labels"][:half, 1:] != -100).sum().clamp(min=1)
            loss = loss - self.cfg.nll_loss_coef * logps[:half].sum() / n
        return loss, metrics
