"""The losses trainers use, as pure functions of logits, labels and log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strategy.model import IGNORE_INDEX as IGNORE
from strategy.trainers.config import POLICY_LOSS_TYPES
from strategy.trainers.losses.advantages import kl_estimate, outcome_advantages


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


def _smoothed(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(z), the label flipped with probability ``label_smoothing`` (conservative)."""
    return -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing


def _robust(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """The unbiased loss under label noise (Chowdhury et al. 2024, rDPO)."""
    return ((-F.logsigmoid(z) * (1 - label_smoothing) + F.logsigmoid(-z) * label_smoothing)
            / (1 - 2 * label_smoothing))


DPO_LOSSES = {  # loss_type -> f(logits, beta, label_smoothing); logits: the log-ratio margin
    "sigmoid": lambda h, beta, ls: _smoothed(beta * h, ls),
    "robust": lambda h, beta, ls: _robust(beta * h, ls),
    "hinge": lambda h, beta, ls: torch.relu(1 - beta * h),  # SLiC
    "ipo": lambda h, beta, ls: (h - 1 / (2 * beta)) ** 2,  # Azar et al. 2023, eq. 17
}


def _reward_metrics(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor) -> dict:
    chosen_reward, rejected_reward = chosen_reward.detach(), rejected_reward.detach()
    return {"reward_accuracy": _mean_pair(chosen_reward > rejected_reward),
            "reward_margin": _mean_pair(chosen_reward - rejected_reward),
            "chosen_reward": _mean_pair(chosen_reward),
            "rejected_reward": _mean_pair(rejected_reward)}


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
               ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
               label_smoothing: float = 0.0,
               loss_type: str = "sigmoid") -> tuple[torch.Tensor, dict]:
    """Per-pair DPO losses from policy/reference log-probs of the chosen and rejected responses
    (``loss_type`` a key of ``DPO_LOSSES``; ``label_smoothing`` for sigmoid and robust); the
    implicit rewards' metrics as (sum, count) pairs."""
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    losses = DPO_LOSSES[loss_type](logits, beta, label_smoothing)
    return losses, _reward_metrics(beta * (policy_chosen - ref_chosen),
                                   beta * (policy_rejected - ref_rejected))


def simpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float,
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per-pair SimPO losses (Meng et al. 2024, eq. 6), ``-log sigmoid(beta (chosen - rejected)
    - gamma)``, from the policy's length-normalised (mean per response token) log-probs; the
    rewards ``beta * mean log-prob`` as (sum, count) metrics."""
    losses = _smoothed(beta * (chosen - rejected) - gamma, label_smoothing)
    return losses, _reward_metrics(beta * chosen, beta * rejected)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0."""
    return torch.log(-torch.expm1(x))


def orpo_losses(chosen: torch.Tensor, rejected: torch.Tensor,
                weight: float) -> tuple[torch.Tensor, dict]:
    """Per-pair ORPO odds-ratio losses (Hong et al. 2024, eq. 7), ``-weight * log sigmoid(log
    odds(chosen) - log odds(rejected))`` with ``odds(y) = p / (1 - p)`` of the mean per-token
    log-prob; the trainer adds the chosen responses' NLL. Metrics: the log odds ratio and the
    rewards ``weight * mean log-prob`` as (sum, count) pairs."""
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    losses = -weight * F.logsigmoid(log_odds)
    return losses, {**_reward_metrics(weight * chosen, weight * rejected),
                    "log_odds_ratio": _mean_pair(log_odds.detach())}


def kto_losses(policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: float,
               beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Per-sample KTO losses (Ethayarajh et al. 2024, eq. 8): ``w_d (1 - sigmoid(beta (r - z0)))``
    for a desirable completion, ``w_u (1 - sigmoid(beta (z0 - r)))`` for an undesirable one, where
    ``r`` is the policy/reference log-ratio of the completion and ``z0`` (``kl``) the detached KL
    reference point. Metrics: the rewards ``beta r`` of each kind as (sum, count) pairs."""
    ratio = policy - ref
    good = desirable.bool()
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    reward = beta * ratio.detach()
    return losses, {"chosen_reward": _mean_pair(reward[good]),
                    "rejected_reward": _mean_pair(reward[~good])}


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> tuple[torch.Tensor, dict]:
    """The mean DPO loss over pairs, with mean metrics."""
    losses, metrics = dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta,
                                 label_smoothing, loss_type)
    return losses.mean(), {key: total / count for key, (total, count) in metrics.items()}


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each completion's reward less its group's mean, over the group's
    (unbiased) standard deviation plus ``eps``; a group of equal rewards gets zeros. ``rewards``
    holds consecutive groups of ``group_size`` (``outcome_advantages``' ``group_norm``)."""
    return outcome_advantages(rewards, group_size, "group_norm", eps)


def grpo_token_losses(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                      beta: float, clip_eps_high: float | None = None,
                      dual_clip: float | None = None, kl_estimator: str = "k3",
                      policy_loss_type: str = "ppo") -> tuple[torch.Tensor, dict]:
    """Per-token policy-gradient loss plus ``beta`` times an estimate of KL(policy || reference)
    (``kl_estimate``: k3 by default), zero where ``mask`` is off; and the KL, the ratio and the
    clipped fraction as (sum, count) over scored tokens.

    ``policy_loss_type``: ``ppo``, each token's ratio clipped to ``[1 - clip_eps,
    1 + clip_eps_high]`` (``clip_eps_high`` None: the same eps both sides; DAPO raises the upper
    one); ``gspo``, the same clip on each completion's ratio, the exponent of its mean token
    log-ratio (GSPO, OpenRLHF's ``gspo``, TRL's ``importance_sampling_level="sequence"``);
    ``cispo``, ``-sg(min(ratio, 1 + clip_eps_high)) * advantage * logp``: the weight is clipped,
    not the gradient, so every token keeps one (CISPO; TRL's ``cispo`` with ``epsilon_high`` =
    1 + ``clip_eps_high``; its clipped share counts, as TRL's, the tokens with a positive
    advantage whose weight was clamped). ``dual_clip`` (> 1, dual-clip PPO, ppo and gspo)
    bounds a negative advantage's loss at ``-dual_clip * advantage``, as OpenRLHF's
    ``PolicyLoss``.
    ``advantages`` has one value per row, or one per token.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if policy_loss_type == "cispo":
        ratio = torch.exp(logp - old_logp)
        objective = torch.clamp(ratio, max=1 + high).detach() * adv * logp
        was_clipped = (ratio > 1 + high) & (adv > 0)  # TRL's cispo_clip_ratio: where the
        # clamp lowers the weight of a token the update pushes up
    else:
        ratio = torch.exp(_log_ratio(logp, old_logp, mask, policy_loss_type))
        unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
        objective, was_clipped = torch.min(unclipped, clipped), clipped < unclipped
        if dual_clip is not None:
            objective = torch.where(adv < 0, torch.max(objective, dual_clip * adv), objective)
    kl = kl_estimate(logp, ref_logp, kl_estimator)
    losses = (-objective + beta * kl) * mask
    scored = mask.bool()
    return losses, {"kl": _mean_pair(kl.detach()[scored]),
                    "ratio": _mean_pair(ratio.detach().expand_as(logp)[scored]),
                    "clip_fraction": _mean_pair(was_clipped.expand_as(logp)[scored])}


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
               policy_loss_type: str) -> torch.Tensor:
    """Each token's log-ratio (``ppo``), or its completion's mean over scored tokens, as a
    ``[rows, 1]`` column (``gspo``)."""
    log_ratio = logp - old_logp
    if policy_loss_type == "ppo":
        return log_ratio
    if policy_loss_type != "gspo":
        raise ValueError(f"policy_loss_type {policy_loss_type!r}: use {POLICY_LOSS_TYPES}")
    per_row = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_row.unsqueeze(-1)


def engine_is_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                      kind: str, low: float, high: float) -> tuple[torch.Tensor, dict]:
    """The rollout engine's importance-sampling correction (OpenRLHF's vLLM IS correction): each
    token's weight ``exp(old_logp - engine_logp)``, the trainer's log-prob of the sampled token
    over the engine's, detached; ``tis`` clamps it to ``[low, high]``, ``icepop`` zeroes it
    outside. Zero where ``mask`` is off; the token losses are multiplied by it. Also the mean
    weight and the share of tokens clamped or zeroed, as (sum, count) over scored tokens."""
    ratio = torch.exp(old_logp - engine_logp).detach()
    outside = (ratio < low) | (ratio > high)
    if kind == "icepop":
        weights = ratio * ~outside
    elif kind == "tis":
        weights = ratio.clamp(min=low, max=high)
    else:
        raise ValueError(f"is_correction {kind!r}: use tis or icepop")
    scored = mask.bool()
    return weights * mask, {"is_weight": _mean_pair(weights[scored]),
                            "is_outside": _mean_pair(outside[scored])}


def engine_logprob_gap(old_logp: torch.Tensor, engine_logp: torch.Tensor,
                       mask: torch.Tensor) -> tuple[tuple[float, int], float]:
    """The rollout engine's sampled-token log-probs against the trainer's on the scored tokens:
    the mean |trainer - engine| as a (sum, count) pair, and the largest (0 for none)."""
    diff = (old_logp - engine_logp).detach().abs()[mask.bool()]
    return _mean_pair(diff), diff.max().item() if diff.numel() else 0.0


def value_token_losses(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float | None = None,
                       ) -> tuple[torch.Tensor, dict]:
    """A critic's per-token loss, ``0.5 * (value - return)^2``, zero where ``mask`` is off; with
    ``clip`` the larger of that and the loss of the value clipped to ``old_values +- clip``
    (OpenRLHF's ``ValueLoss``, whose 0.5 is taken here per token). Also the mean value and the
    clipped fraction as (sum, count) over scored tokens."""
    losses = (values - returns).pow(2)
    scored = mask.bool()
    metrics = {"values": _mean_pair(values.detach()[scored])}
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped_losses = (clipped - returns).pow(2)
        metrics["value_clip_fraction"] = _mean_pair((clipped_losses > losses).detach()[scored])
        losses = torch.max(clipped_losses, losses)
    return 0.5 * losses * mask, metrics
