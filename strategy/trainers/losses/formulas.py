"""The losses trainers use, as pure functions of logits, labels and log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strategy.model import IGNORE_INDEX as IGNORE


def response_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over tokens whose label is not -100 (prompt and padding)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    count = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss / max(count, 1), count


def _mean_pair(values: torch.Tensor) -> tuple[float, int]:
    """A metric as (sum, count), so means over many micro-batches and ranks stay exact."""
    return values.float().sum().item(), values.numel()


def pairwise_losses(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Per-pair Bradley-Terry losses, and accuracy and margin as (sum, count) pairs."""
    margin = chosen - rejected
    return -F.logsigmoid(margin), {"accuracy": _mean_pair(margin > 0),
                                   "reward_margin": _mean_pair(margin.detach())}


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The mean Bradley-Terry loss and how often the chosen response scores higher."""
    losses, metrics = pairwise_losses(chosen, rejected)
    return losses.mean(), {key: total / count for key, (total, count) in metrics.items()}


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
               ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per-pair DPO losses (conservative with ``label_smoothing``) from policy/reference
    log-probs of the chosen and rejected responses; metrics as (sum, count) pairs."""
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    chosen_reward = beta * (policy_chosen - ref_chosen).detach()
    rejected_reward = beta * (policy_rejected - ref_rejected).detach()
    return losses, {"reward_accuracy": _mean_pair(chosen_reward > rejected_reward),
                    "reward_margin": _mean_pair(chosen_reward - rejected_reward),
                    "chosen_reward": _mean_pair(chosen_reward),
                    "rejected_reward": _mean_pair(rejected_reward)}


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The mean DPO loss over pairs, with mean metrics."""
    losses, metrics = dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta,
                                 label_smoothing)
    return losses.mean(), {key: total / count for key, (total, count) in metrics.items()}


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each completion's reward less its group's mean, over the group's
    (unbiased) standard deviation plus ``eps``; a group of equal rewards gets zeros. ``rewards``
    holds consecutive groups of ``group_size``."""
    groups = rewards.float().view(-1, group_size)
    mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


def grpo_token_losses(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                      beta: float) -> tuple[torch.Tensor, dict]:
    """Per-token clipped policy-gradient loss plus ``beta`` times the k3 estimate of
    KL(policy || reference), ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased), zero where
    ``mask`` is off; and the KL, the ratio and the clipped fraction as (sum, count) over scored
    tokens.
    ``advantages`` has one value per row."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    gap = ref_logp - logp
    kl = torch.exp(gap) - gap - 1
    losses = (-torch.min(unclipped, clipped) + beta * kl) * mask
    scored = mask.bool()
    was_clipped = (clipped < unclipped)[scored]
    return losses, {"kl": _mean_pair(kl.detach()[scored]),
                    "ratio": _mean_pair(ratio.detach()[scored]),
                    "clip_fraction": _mean_pair(was_clipped)}
