"""OpenRLHF's on-policy math, transcribed as pure torch functions for cross-checks.

Source: https://github.com/OpenRLHF/OpenRLHF at ``3c3be623`` ("Cleanup/simplicity tier1 2
(#1307)"), read from a git snapshot: ``openrlhf/trainer/ppo_utils/experience_maker.py``
(``compute_advantages_and_returns``: the reward shaping by estimator and the whitening;
``get_advantages_and_returns``; ``get_cumulative_returns``), ``openrlhf/models/utils.py``
(``compute_approx_kl``, ``compute_reward``) and ``openrlhf/models/loss.py`` (``PolicyLoss``'s
surrogate and dual clip, before aggregation; ``ValueLoss`` with ``aggregate_loss``). Only
``self``/``args`` plumbing is dropped; the arithmetic order is the peer's. ``multi_turn_execute``
is ``openrlhf/utils/agent.py``'s ``MultiTurnAgentExecutor.execute`` (text prompts) at the same
commit, the vLLM engine a callable.
"""

from __future__ import annotations

import torch


def shaped_rewards(rewards: torch.Tensor, n_samples_per_prompt: int,
                   estimator: str) -> torch.Tensor:
    """The baseline step of ``compute_advantages_and_returns`` (one reward per sample)."""
    rewards = rewards.reshape(-1, n_samples_per_prompt)
    if estimator == "rloo":
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (n_samples_per_prompt - 1)
        rewards = rewards - baseline
    elif estimator in ["reinforce_baseline", "dr_grpo"]:
        rewards = rewards - rewards.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (
            rewards.std(-1, keepdim=True) + 1e-9)
    return rewards.reshape(-1)


def compute_reward(r: torch.Tensor, kl_coef: float, kl: torch.Tensor,
                   action_mask: torch.Tensor) -> torch.Tensor:
    """The sequence reward on its last action token, plus ``-kl_coef * kl`` per token."""
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices,
                                                src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def get_cumulative_returns(rewards: torch.Tensor, action_mask: torch.Tensor,
                           gamma: float) -> torch.Tensor:
    response_length = rewards.size(1)
    returns = torch.zeros_like(rewards)
    cumulative_return = torch.zeros(rewards.size(0), device=rewards.device)
    if action_mask is not None:
        rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        cumulative_return = rewards[:, t] + gamma * cumulative_return
        returns[:, t] = cumulative_return
    return returns


def get_advantages_and_returns(values: torch.Tensor, rewards: torch.Tensor,
                               action_mask: torch.Tensor, gamma: float, lambd: float):
    lastgaelam = 0
    advantages_reversed = []
    response_length = rewards.size(1)
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages.detach(), returns


def whiten(advantages: list[torch.Tensor], action_masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The normalization over all experiences (``no_std_norm`` off)."""
    all_advantages = torch.cat([a.flatten() for a in advantages], dim=0).float()
    all_action_masks = torch.cat([m.flatten() for m in action_masks], dim=0)
    num_actions = all_action_masks.sum()
    mean = (all_advantages * all_action_masks).sum() / num_actions
    var = ((all_advantages - mean).pow(2) * all_action_masks).sum() / num_actions
    rstd = var.clamp(min=1e-8).rsqrt()
    return [(a - mean) * rstd for a in advantages]


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor,
                      kl_estimator: str = "k1") -> torch.Tensor:
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def policy_token_loss(log_probs, old_log_probs, advantages, clip_eps_low, clip_eps_high,
                      dual_clip=None) -> torch.Tensor:
    """``PolicyLoss.forward``'s per-token loss (``policy_loss_type="ppo"``), before
    ``aggregate_loss``."""
    policy_log_ratio = (log_probs - old_log_probs).clamp(min=-20.0, max=20.0)
    ratio = policy_log_ratio.exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    if dual_clip is None:
        return -torch.min(surr1, surr2)
    clip1 = torch.min(surr1, surr2)
    clip2 = torch.max(clip1, dual_clip * advantages)
    return -torch.where(advantages < 0, clip2, clip1)


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(axis=dim) / mask.sum(axis=dim)


def value_loss(values, old_values, returns, action_mask, clip_eps=None,
               token_level_loss=True) -> torch.Tensor:
    """``ValueLoss.forward`` with ``aggregate_loss`` (no global counts: this batch's mean)."""
    if clip_eps is not None:
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        surr1 = (values_clipped - returns) ** 2
        surr2 = (values - returns) ** 2
        loss = torch.max(surr1, surr2)
    else:
        loss = (values - returns) ** 2
    if token_level_loss:
        loss = masked_mean(loss, action_mask, dim=None)
    else:
        token_counts = action_mask.sum(dim=-1)
        seq_loss = (loss * action_mask).sum(dim=-1) / (token_counts + 1e-8)
        seq_mask = (token_counts > 0).float()
        loss = masked_mean(seq_loss, seq_mask, dim=None)
    return 0.5 * loss


def gspo_policy_loss(log_probs, old_log_probs, advantages, action_mask, clip_eps_low,
                     clip_eps_high, dual_clip=None) -> torch.Tensor:
    """``PolicyLoss.forward`` with ``policy_loss_type="gspo"`` (no vLLM correction), then its
    ``aggregate_loss`` (GSPO forces ``token_level_loss=False``: the mean of per-sequence token
    means, fully masked sequences left out)."""
    log_ratio = log_probs - old_log_probs
    ratio = (log_ratio * action_mask).sum(dim=-1) / action_mask.sum(dim=-1).clamp(min=1)
    ratio = ratio.exp().unsqueeze(-1) * action_mask
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * advantages)
        loss = -torch.where(advantages < 0, clip2, clip1)
    token_counts = action_mask.sum(dim=-1)
    seq_loss = (loss * action_mask).sum(dim=-1) / (token_counts + 1e-8)
    seq_mask = (token_counts > 0).float()
    return masked_mean(seq_loss, seq_mask, dim=None)


# TRL 1.16.0 ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py, read from the PyPI
# wheel): the importance weights by ``importance_sampling_level``, the ``cispo`` and clipped
# (``grpo``/``dapo``) per-token losses, and their normalisations, for one process without
# accumulation (``num_items_in_batch`` = the batch's completion tokens), beta 0.
def trl_per_token_loss(per_token_logps, old_per_token_logps, advantages, mask, loss_type,
                       epsilon_low, epsilon_high, importance_sampling_level="token"):
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # cispo, dapo


def trl_cispo_clip_ratio(per_token_logps, old_per_token_logps, advantages, mask, epsilon_high):
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s ``cispo_clip_ratio`` (``loss_type="cispo"``):
    the share of scored tokens whose weight the clamp lowered, among those with a positive
    advantage."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    is_cispo_clipped = (coef_1 > epsilon_high) & (advantages > 0)
    return (is_cispo_clipped.float() * mask).sum() / mask.sum().clamp(min=1.0)


def apply_length_penalties(rewards, response_length, truncated, max_new_tokens,
                           overlong_buffer_len=None, overlong_penalty_factor=1.0,
                           stop_properly_penalty_coef=None):
    """``openrlhf/trainer/ppo_utils/length_penalty.py``'s ``apply_overlong_penalty`` then
    ``apply_stop_properly_penalty`` (``apply_length_penalties``' order) on one experience's
    rewards, row by row as there; returns the rewards and each penalty's count."""
    rewards, counts = rewards.clone(), [0, 0]
    if overlong_buffer_len is not None:
        expected_len = max_new_tokens - overlong_buffer_len
        for j in range(len(response_length)):
            valid_response_length = response_length[j].item()
            exceed_len = min(valid_response_length - expected_len, overlong_buffer_len)
            if exceed_len > 0:
                rewards[j] += -exceed_len / overlong_buffer_len * overlong_penalty_factor
                counts[0] += 1
    if stop_properly_penalty_coef is not None:
        for j in range(len(truncated)):
            if truncated[j].item():
                if stop_properly_penalty_coef < 0:
                    rewards[j] = stop_properly_penalty_coef
                else:
                    rewards[j] = rewards[j] * stop_properly_penalty_coef
                counts[1] += 1
    return rewards, counts


def dynamic_filter_keeps(scores: list[list[float]], dynamic_filtering_range) -> list[bool]:
    """``SamplesGenerator._generate_vllm``'s filter (``ppo_utils/samples_generator.py``): a
    prompt's experiences are dropped when ``not (min_r < avg_reward < max_r)``."""
    out = []
    for group in scores:
        avg_reward = sum(group) / len(group)
        min_r, max_r = dynamic_filtering_range
        out.append(not (not (min_r < avg_reward < max_r)))
    return out


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5,
                             temperature=1.0, reduction="batchmean", num_items_in_batch=None):
    """TRL 1.16.0's ``GKDTrainer.generalized_jsd_loss`` (``trl/experimental/gkd/gkd_trainer.py``,
    from the ``trl-1.16.0-py3-none-any.whl`` on PyPI), transcribed; only the reductions used
    here are kept (``num_items_in_batch``, ``batchmean``)."""
    import torch.nn.functional as F

    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta),
                         teacher_log_probs + torch.log(beta)]),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none",
                              log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none",
                              log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        return jsd.sum() / num_items_in_batch
    denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
    return jsd.sum() / denom


def vllm_is_corrected_loss(log_probs, old_log_probs, advantages, rollout_log_probs,
                           clip_eps_low, clip_eps_high, threshold, correction_type):
    """``PolicyLoss.forward``'s ppo surrogate times its vLLM importance-sampling correction
    (``enable_vllm_is_correction``, ``vllm_is_truncated_threshold``,
    ``vllm_is_correction_type`` tis or icepop), before aggregation."""
    loss = policy_token_loss(log_probs, old_log_probs, advantages, clip_eps_low, clip_eps_high)
    low_threshold, high_threshold = threshold
    rollout_log_ratio = old_log_probs - rollout_log_probs
    if correction_type == "icepop":
        vllm_is = torch.exp(rollout_log_ratio).detach()
        mask = (vllm_is >= low_threshold) & (vllm_is <= high_threshold)
        vllm_is = vllm_is * mask
        loss = vllm_is * loss
    else:
        vllm_is = torch.exp(rollout_log_ratio).clamp(min=low_threshold,
                                                     max=high_threshold).detach()
        loss = vllm_is * loss
    return loss


def multi_turn_execute(agent_instance_cls, prompt: str, label, generate, max_length: int,
                       hf_tokenizer):
    """``MultiTurnAgentExecutor.execute`` (``openrlhf/utils/agent.py``, text prompts, no images,
    no initial truncation): ``generate(token_ids, max_tokens) -> (action token ids, action
    text)`` stands for ``llm_engine.generate``; its return's token fields."""
    import asyncio

    async def execute():
        agent_instance = agent_instance_cls()
        reset_result = await agent_instance.reset({"observation": prompt, "label": label})
        observation_text = reset_result["observation"]
        current_obs_tokens = hf_tokenizer(text=observation_text, add_special_tokens=False,
                                          return_tensors="pt")["input_ids"][0].tolist()
        action_ranges, total_reward = [], 0
        while True:
            max_tokens = max_length - len(current_obs_tokens)
            if max_tokens <= 0:
                break
            action_tokens, action_text = generate(current_obs_tokens, max_tokens)
            action_start = len(current_obs_tokens)
            action_ranges.append((action_start, action_start + len(action_tokens)))
            states = {"observation_text": observation_text, "action_text": action_text,
                      "label": label, "sampling_params": None}
            step_result = await agent_instance.step(states)
            total_reward += step_result["rewards"].item()
            environment_feedback_text = step_result["environment_feedback"]
            done = step_result["done"]
            feedback_tokens = hf_tokenizer(text=environment_feedback_text,
                                           add_special_tokens=False,
                                           return_tensors="pt")["input_ids"][0].tolist()
            observation_text = observation_text + action_text + environment_feedback_text
            current_obs_tokens = current_obs_tokens + action_tokens + feedback_tokens
            if done:
                break
        return {"reward": total_reward, "observation_tokens": current_obs_tokens,
                "action_ranges": action_ranges}

    return asyncio.run(execute())


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """OpenRLHF 0.11.0's ``openrlhf/models/utils.py`` ``compute_entropy`` (its ``@torch.compile``
    dropped): the entropy of the softmax of raw logits, per position; ``ppo_actor.py``
    aggregates it over the action mask as the policy loss and subtracts
    ``actor.entropy_coef`` times it."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
    return entropy


def eval_pass_at_k(rewards: list[float], n_samples_per_prompt: int) -> dict:
    """OpenRLHF 0.11.0's ``openrlhf/trainer/ppo_trainer.py`` ``compute_eval_metrics``, its pass
    figures for one data source: ``pass<k>`` the mean over prompts of each prompt's best reward,
    ``pass1`` the mean over prompts of each prompt's mean reward."""
    rewards = torch.tensor(rewards).reshape(-1, n_samples_per_prompt)
    metrics = {f"pass{n_samples_per_prompt}": 0, "pass1": 0, "count": 0}
    for i in range(rewards.shape[0]):
        chunk = rewards[i]
        if n_samples_per_prompt > 1:
            metrics[f"pass{n_samples_per_prompt}"] += chunk.max().float().item()
        metrics["pass1"] += chunk.mean().float().item()
        metrics["count"] += 1
    return {f"pass{n_samples_per_prompt}": metrics[f"pass{n_samples_per_prompt}"]
            / metrics["count"], "pass1": metrics["pass1"] / metrics["count"]}
