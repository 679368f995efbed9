"""GRPO's update: advantages from a rollout's rewards (``--advantage_estimator``, per token with
``kl_in_reward`` or ``gamma`` < 1) and the clipped policy-gradient loss with its KL term and
engine importance-sampling correction, aggregated by ``--policy_loss_agg``. A mixin of
``GRPOTrainer``: it reads the trainer's ``grpo`` and ``rollout_config`` settings, model and
strategy; PPO overrides ``advantages`` (GAE) and adds its critic's loss."""

from __future__ import annotations

from typing import Callable

import torch

from strategy.trainers.algorithms.completions import regrouped, scattered
from strategy.trainers.algorithms.token_budget import agreed_bounds
from strategy.trainers.loop import Largest
from strategy.trainers.losses import (
    discounted_returns,
    engine_is_weights,
    engine_logprob_gap,
    grpo_token_losses,
    kl_estimate,
    outcome_advantages,
    outcome_token_rewards,
    padding_free,
    scored_mask,
    token_logps,
    token_logps_entropy,
    token_moments,
    whiten,
)
from strategy.trainers.losses.advantages import WHITENED

PER_TURN = ("gae", "reinforce")  # estimators that take each episode turn's reward where it falls


class PolicyUpdate:
    """``advantages`` (and ``token_advantages``), ``compute_loss`` and its ``aggregate``;
    ``trained_mask``, the positions they train."""

    _old_logps: dict  # micro-batch -> the rollout's first update's log-probs

    def trained_mask(self, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` less the rows of completions that train nothing
        (``--mask_truncated_completions``).

        Args:
            batch: a rollout micro-batch.
            mask: its scored positions, rows x tokens.

        Returns:
            The positions the losses train and count.
        """
        trained = batch.get("trained")
        return mask if trained is None else mask & trained.to(mask.device)[:, None]

    def advantages(self, batches: list[dict]) -> None:
        """The experience stage's last step: each micro-batch's ``advantages`` from its
        ``rewards`` (one per completion; ``--advantage_estimator``). With ``kl_in_reward`` or
        ``gamma`` < 1 they are per token (``token_advantages``: discounted returns). The
        whitened estimators use the moments of every rank's completion tokens, so any world size
        gives the single-process values. Subclasses with a critic override this (PPO: GAE).

        Args:
            batches: the rollout's micro-batches (``rewards``, maybe ``ref_logp``), set in place.
        """
        g = self.grpo
        rewards = torch.cat([b["rewards"] for b in batches])
        out = outcome_advantages(rewards, g.group_size, g.advantage_estimator, g.advantage_eps)
        if g.per_token:
            self.token_advantages(batches, out, lambda r, mask, _: discounted_returns(
                r, mask, g.gamma))
            return
        if g.advantage_estimator in WHITENED:
            lengths = torch.cat([self.trained_mask(b, scored_mask(b)).sum(-1).float()
                                 for b in batches])
            out = whiten(out, self.strategy.all_reduce(token_moments(out, lengths), op="sum"))
        for b, part in zip(batches, out.split([len(b["rewards"]) for b in batches])):
            b["advantages"] = part.clone()

    def token_advantages(self, batches: list[dict], outcomes: torch.Tensor,
                         estimate: Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor],
                         ) -> None:
        """Per-token advantages: each completion's ``outcomes`` entry on its last token, less
        ``kl_coef`` x the KL (the policy at rollout time against the reference) on every token
        with ``kl_in_reward``; ``estimate(token_rewards, mask, batch)`` turns them into
        advantages, whitened over every rank's tokens for the whitened estimators (OpenRLHF's
        ``compute_reward``, returns or GAE, and whitening). The KL's policy log-probs (this
        rollout's pass) become the first update's "old" ones (``old_logp``).

        Args:
            batches: the rollout's micro-batches, set in place.
            outcomes: one outcome per completion, in batch order.
            estimate: token rewards, their mask, the micro-batch -> advantages.
        """
        g, masks, offset = self.grpo, [], 0
        if g.kl_in_reward:  # the rollout's policy against the reference
            self.rollout_logps([b for b in batches if "ref_logp" in b])
        for b in batches:
            mask = scored_mask(b).float()
            rows = mask.shape[0]
            rewards = outcome_token_rewards(outcomes[offset:offset + rows].float(), mask)
            if "turn_rewards" in b and g.advantage_estimator in PER_TURN:  # rewards as given
                rewards = b["turn_rewards"].float() * mask
            offset += rows
            if g.kl_in_reward and "ref_logp" in b:
                rewards = rewards - g.kl_coef * kl_estimate(b["old_logp"], b["ref_logp"],
                                                            g.kl_estimator) * mask
            b["advantages"] = estimate(rewards, mask, b)
            masks.append(self.trained_mask(b, mask.bool()).float())
        if g.advantage_estimator in WHITENED:
            scored = torch.cat([b["advantages"][m.bool()] for b, m in zip(batches, masks)])
            moments = self.strategy.all_reduce(token_moments(scored, torch.ones_like(scored)),
                                               op="sum")
            for b, m in zip(batches, masks):
                b["advantages"] = whiten(b["advantages"], moments) * m


    def rollout_logps(self, batches: list[dict]) -> None:
        """Each micro-batch's ``old_logp`` (where the experience stage set none) from the policy
        as it sampled the rollout: a rollout trained over several optimizer steps
        (``--rollout_batch_size``) has micro-batches first seen after an update, whose ratio must
        still be to the rollout's policy (OpenRLHF's ``action_log_probs``). Collective under
        ZeRO-3: every rank holds as many micro-batches.

        Args:
            batches: the rollout's micro-batches, set in place.
        """
        missing = [b for b in batches if "old_logp" not in b]

        def forward(parts: list[dict]) -> list[torch.Tensor]:
            with torch.no_grad():
                return [token_logps(self.model, self.to_device(b), self.grpo.temperature)[0].cpu()
                        for b in parts]

        for b, logp in zip(missing, self.experience_forwards(missing, forward)):
            b["old_logp"] = logp

    def experience_forwards(self, batches: list[dict],
                            forward: Callable[[list[dict]], list[torch.Tensor]],
                            ) -> list[torch.Tensor]:
        """``forward``'s per-token outputs (``token_logps``' layout) for each micro-batch, run
        on micro-batches of ``--micro_rollout_batch_size`` rows of the same completions
        (OpenRLHF's ``--rollout.micro_batch_size``), or with ``--dynamic_batch`` of the
        ``--rollout_max_tokens_per_gpu`` budget (collective: the most any rank needs), and laid
        back out as ``batches``; with neither, on ``batches`` themselves. Every rank runs as
        many forwards.

        Args:
            batches: the rollout's micro-batches (``completion_batch``'s rows).
            forward: micro-batches -> one output each (the reference's, the policy's or the
                critic's forward, on the CPU).

        Returns:
            One output per micro-batch of ``batches``.
        """
        g = self.grpo
        if not batches or not (g.dynamic_batch or g.micro_rollout_batch_size):
            return forward(batches)
        lengths = [int(mask.sum()) for b in batches for mask in b["attention_mask"]]
        if g.dynamic_batch:  # the experience budget; every rank as many forwards
            budget = g.rollout_max_tokens_per_gpu or g.max_tokens_per_gpu
            sizes = [end - first for first, end, _ in agreed_bounds(
                self.strategy, lengths, 1, budget, self.packing)]
        else:
            size = g.micro_rollout_batch_size
            sizes = [min(size, len(lengths) - i) for i in range(0, len(lengths), size)]
        parts = regrouped(batches, sizes, self.tokenizer.pad_token_id)
        if self.packing:  # the forwards skip the padding, as the micro-batches' own would
            for part in parts:
                part.update(padding_free(part["input_ids"], part["attention_mask"]))
        return scattered(forward(parts), batches)

    def loss_counts(self, batch: dict) -> dict[str, int]:
        if "prompt_ids" in batch:  # evaluation: prompts
            return {"samples": int(batch["prompt_ids"].shape[0])}
        scored = self.trained_mask(batch, scored_mask(batch)).sum(dim=-1)
        return {"tokens": int(scored.sum()), "completions": int((scored > 0).sum())}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        bonus = self.grpo.entropy_coef
        logp, mask, entropy = token_logps_entropy(  # the sampler's distribution's
            self.model, batch, self.grpo.temperature, "trained" if bonus else "logged")
        mask = self.trained_mask(batch, mask)
        key = batch["rollout_index"]  # which micro-batch of the rollout
        gap = {}
        if key not in self._old_logps:  # the rollout's first update: ratio 1 (kl_in_reward: the
            self._old_logps[key] = batch.get("old_logp", logp.detach())  # rollout's own pass)
            if "engine_logp" in batch:  # the engine's log-probs beside the trainer's, once
                mean, largest = engine_logprob_gap(self._old_logps[key], batch["engine_logp"],
                                                   mask)
                gap = {"engine_logprob_diff": mean, "engine_logprob_diff_max": Largest(largest)}
        ref = batch.get("ref_logp", logp.detach())
        g = self.grpo
        low, high = g.clip_bounds
        losses, metrics = grpo_token_losses(
            logp, self._old_logps[key], ref, batch["advantages"], mask, low,
            0.0 if g.kl_in_reward else g.kl_coef, clip_eps_high=high, dual_clip=g.dual_clip,
            kl_estimator=g.kl_estimator, policy_loss_type=g.policy_loss_type)
        correction = self.rollout_config.is_correction
        if correction is not None:  # the engine's log-probs differ from the trainer's
            low_w, high_w = self.rollout_config.is_correction_threshold
            weights, more = engine_is_weights(self._old_logps[key], batch["engine_logp"], mask,
                                              correction, low_w, high_w)
            losses, metrics = losses * weights, {**metrics, **more}
        loss = self.aggregate(losses, mask)
        if bonus:  # OpenRLHF's: aggregated as the policy loss, not importance-weighted
            loss = loss - bonus * self.aggregate(entropy * mask, mask)
        scored = entropy.detach()[mask.bool()]
        return loss, {**metrics, **gap, "entropy": (scored.sum().item(), scored.numel())}

    def aggregate(self, losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step's loss over its token ``losses``
        (``policy_loss_agg``).

        Args:
            losses: per-token losses, zero where ``mask`` is off.
            mask: the scored (completion) tokens.

        Returns:
            The share, for ``compute_loss``.
        """
        if self.grpo.policy_loss_agg == "token_mean":
            return self.normalize(losses.sum(), "tokens")
        if self.grpo.policy_loss_agg == "seq_mean_token_mean":
            per_completion = losses.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        else:  # seq_mean_token_sum_norm: Dr. GRPO's constant length
            per_completion = losses.sum(dim=-1) / self.grpo.max_new_tokens
        return self.normalize(per_completion.sum(), "completions")
