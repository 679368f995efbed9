"""Advantages and returns for on-policy training, with OpenRLHF's meanings
(``openrlhf/trainer/ppo_utils/experience_maker.py``: ``compute_advantages_and_returns``,
``get_advantages_and_returns``, ``get_cumulative_returns``).

Outcome rewards (one per completion, ``group_size`` consecutive completions per prompt):

- ``group_norm`` (GRPO): reward less its group's mean, over the group's std plus ``eps``.
- ``dr_grpo`` (Dr. GRPO) and ``reinforce_baseline`` (REINFORCE++-baseline): reward less its
  group's mean; ``reinforce_baseline`` is then whitened over the rollout.
- ``rloo``: reward less the mean of the *other* completions of its group.
- ``reinforce`` (REINFORCE++): the reward itself, whitened over the rollout.
- ``gae``: needs a value model (PPO's critic): ``gae`` below.

Whitening follows OpenRLHF: the mean and variance over every completion token of the rollout
(each completion weighs by its length), so the caller sums ``token_moments`` over all ranks and the
result is the single-process one at any world size. OpenRLHF's group std is ``+ 1e-9``; ours keeps
``--advantage_eps`` (TRL's 1e-4), so a zero-variance group gives zeros in both.
"""

from __future__ import annotations

import torch

from strategy.trainers.config import OUTCOME_ESTIMATORS

ESTIMATORS = ("gae", *OUTCOME_ESTIMATORS)
WHITENED = ("gae", "reinforce", "reinforce_baseline")


def outcome_advantages(rewards: torch.Tensor, group_size: int, estimator: str,
                       eps: float = 1e-4) -> torch.Tensor:
    """One advantage per completion from its outcome reward (before any whitening).

    Args:
        rewards: consecutive groups of ``group_size`` rewards.
        group_size: completions per prompt.
        estimator: one of ``OUTCOME_ESTIMATORS``.
        eps: added to the group std (``group_norm``).

    Returns:
        The advantages, shaped like ``rewards``.
    """
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if estimator == "group_norm":
        out = (groups - mean) / (groups.std(dim=1, keepdim=True) + eps)
    elif estimator in ("dr_grpo", "reinforce_baseline"):
        out = groups - mean
    elif estimator == "rloo":
        out = groups - (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    elif estimator == "reinforce":
        out = groups
    else:
        raise ValueError(f"advantage_estimator={estimator!r}: use one of {OUTCOME_ESTIMATORS}")
    return out.reshape(-1)


def token_moments(values: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """Sums for a token-weighted mean and variance of per-completion ``values``, each counted
    ``lengths`` times: add them over ranks, then ``whiten``."""
    values, weights = values.double(), lengths.double()
    return {"sum": (values * weights).sum().item(), "sq": (values.pow(2) * weights).sum().item(),
            "n": weights.sum().item()}


def whiten(values: torch.Tensor, moments: dict[str, float]) -> torch.Tensor:
    """``(values - mean) / std`` with the token-weighted moments of the whole rollout (variance
    clamped at 1e-8, as OpenRLHF)."""
    n = max(moments["n"], 1.0)
    mean = moments["sum"] / n
    var = max(moments["sq"] / n - mean * mean, 1e-8)
    return ((values.double() - mean) / var ** 0.5).to(values.dtype)


def outcome_token_rewards(outcome: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's ``outcome`` on its last masked token, zero elsewhere (rows x tokens), as
    OpenRLHF's ``compute_reward`` places a sequence reward."""
    last = mask.shape[1] - 1 - mask.long().flip(1).argmax(dim=1, keepdim=True)
    return torch.zeros(mask.shape, dtype=outcome.dtype).scatter_(1, last, outcome.unsqueeze(1))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE returns per token: ``G_t = r_t + gamma * G_{t+1}`` over masked ``rewards``
    (rows x tokens); unmasked positions between masked ones (an episode's feedback between its
    turns: ``gaps``) are skipped, not discounted over, and zero."""
    gap = gaps(mask)
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(gap[:, t], running, rewards[:, t] + gamma * running)
        returns[:, t] = running.masked_fill(gap[:, t], 0.0)
    return returns


def gaps(mask: torch.Tensor) -> torch.Tensor:
    """Unmasked positions with masked ones on both sides in their row (rows x tokens): an
    episode's feedback between two model turns. A single completion has none."""
    keep = mask.bool().long()
    after_first = keep.cummax(dim=1).values.bool()
    before_last = keep.flip(1).cummax(dim=1).values.flip(1).bool()
    return ~keep.bool() & after_first & before_last


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation per token (rows x tokens):
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lambd * A_{t+1}``,
    returns ``A_t + V_t``; rewards and values are masked first, the value after the last token
    is 0. An episode's feedback between two model turns (``gaps``) is the environment's
    transition: skipped (``t + 1`` is the next turn's first token), zero there.

    Returns:
        ``(advantages, returns)``.
    """
    gap = gaps(mask)
    rewards, values = rewards * mask, values * mask
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    following = torch.zeros_like(running)  # the value at the next position not in a gap
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        step = rewards[:, t] + gamma * following - values[:, t] + gamma * lambd * running
        running = torch.where(gap[:, t], running, step)
        following = torch.where(gap[:, t], following, values[:, t])
        advantages[:, t] = running.masked_fill(gap[:, t], 0.0)
    return advantages, advantages + values


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1,
    k2, k3; OpenRLHF's ``compute_approx_kl``): k1 ``logp - ref``, k2 ``(logp - ref)^2 / 2``,
    k3 ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased)."""
    gap = ref_logp - logp
    if kind == "k1":
        return -gap
    if kind == "k2":
        return gap.pow(2) / 2
    if kind == "k3":
        return torch.exp(gap) - gap - 1
    raise ValueError(f"kl_estimator={kind!r}: use k1, k2 or k3")


def length_shaped_rewards(rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor,
                          max_new_tokens: int, overlong_buffer_len: float | None = None,
                          overlong_penalty_factor: float = 1.0,
                          stop_properly_penalty_coef: float | None = None,
                          ) -> tuple[torch.Tensor, dict]:
    """Rewards shaped by completion length, in OpenRLHF's order (``length_penalty.py``): DAPO's
    soft overlong punishment, then ProRL's stop-properly penalty.

    Args:
        rewards: one reward per completion.
        lengths: each completion's tokens (its end-of-sequence token included).
        truncated: which completions stopped at ``max_new_tokens`` without ending.
        max_new_tokens: the longest completion.
        overlong_buffer_len: a completion longer than ``max_new_tokens`` less this loses
            ``overlong_penalty_factor`` x its excess over it (at most this) / this (None: off).
        overlong_penalty_factor: the largest overlong penalty.
        stop_properly_penalty_coef: a truncated completion's reward times this (in [0, 1]), or
            this value itself when negative (None: off).

    Returns:
        The shaped rewards, and the completions each penalty hit as (count, completions).
    """
    out, n = rewards.clone().float(), len(rewards)
    hits = {}
    if overlong_buffer_len is not None:
        exceed = (lengths.float() - (max_new_tokens - overlong_buffer_len)).clamp(
            max=overlong_buffer_len)
        hit = exceed > 0
        out = out + torch.where(hit, -exceed / overlong_buffer_len * overlong_penalty_factor, 0.0)
        hits["overlong_penalized"] = (float(hit.sum()), n)
    if stop_properly_penalty_coef is not None:
        coef = stop_properly_penalty_coef
        out = torch.where(truncated, torch.full_like(out, coef) if coef < 0 else out * coef, out)
        hits["truncated_penalized"] = (float(truncated.sum()), n)
    return out, hits
