"""The on-policy trainers' own settings: GRPO (and its estimators, losses, episodes), PPO's critic,
distillation."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from strategy.config.fields import check_positive, check_steps, doc
from strategy.errors import fail
from strategy.model import saved_reward_scale
from strategy.rollout import GATHER_MODES
from strategy.trainers.config.common import check_sampling, positive

# on-policy: advantage estimators from outcome rewards (OpenRLHF's names; gae needs a critic),
# policy-loss aggregations (verl's names) and KL estimators
OUTCOME_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline")
GROUPED = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")  # baselines from the group
POLICY_LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo")  # their formulas: losses.formulas.grpo_token_losses
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class GRPOConfig:
    """Group relative policy optimization: sampling, reward, and the clipped update."""

    group_size: int = doc("GRPO: completions sampled per prompt (G >= 2 for the group "
                          "baselines); train_batch_size counts completions, so it is G x prompts "
                          "per rollout", 8)
    reward_fn: str | None = doc("GRPO: reward callables 'module:function', comma-separated, "
                                "each called as f(prompt, completion, row) -> float (or, with "
                                "f.batched = True, f(prompts, completions, rows) -> floats)", None)
    reward_pretrain: str | None = doc("GRPO: reward model directory (AutoModelForSequence"
                                      "Classification, 1 label), alone or with --reward_fn", None)
    normalize_reward: bool = doc("GRPO: the reward model's score as (score - mean) / std, with "
                                 "the mean and std its config.json holds (OpenRLHF's reward "
                                 "models save them; its --reward.normalize_enable); PPO's critic "
                                 "values too, where its start's config.json holds them (as "
                                 "OpenRLHF's critic). A remote reward is taken as it comes",
                                 False)
    remote_rm_url: str | None = doc(
        "GRPO: OpenRLHF's reward source (its --reward.remote_url): a Python file defining "
        "reward_func(queries, prompts, labels) -> {'rewards', 'scores', 'extra_logs'}, or reward "
        "server URLs, comma-separated, answering POST {query, prompts, labels} so (python -m "
        "strategy.cli.serve_rm); labels from --label_key", None)
    reward_weights: str | None = doc("GRPO: comma-separated weights of the rewards, in order: "
                                     "each --reward_fn, then the reward model, then "
                                     "--remote_rm_url (default all 1)", None)
    reward_timeout: float = doc("GRPO: seconds a reward function may take per sample (per "
                                "batch when batched); > 0 runs the functions in a worker "
                                "process, killed on a hang (0: in the rank, no limit)", 0.0)
    kl_coef: float = doc("GRPO: weight of the k3 KL penalty to the reference model (0: no "
                         "reference at all)", 0.04)
    clip_eps: float = doc("GRPO: policy ratio clip range, 1 +- eps", 0.2)
    entropy_coef: float = doc(
        "GRPO: entropy bonus: the loss less entropy_coef x the scored tokens' entropy of the "
        "sampler's distribution, aggregated as the policy loss (OpenRLHF's --actor.entropy_coef; "
        "0: none; the entropy is logged either way)", 0.0)
    ppo_epochs: int = doc("GRPO: passes over each rollout (OpenRLHF's --train.max_epochs)", 1)
    rollout_batch_size: int | None = doc(
        "GRPO: prompts per rollout on all ranks, each sampled group_size times; its completions "
        "train in optimizer steps of train_batch_size (OpenRLHF's --rollout.batch_size; None: "
        "one step's, train_batch_size / group_size)", None)
    save_rollouts: int | None = doc(
        "GRPO: save a resume checkpoint every N rollouts, which sets --save_steps to N x the "
        "optimizer steps a rollout spans (OpenRLHF's --ckpt.save_steps, which counts rollouts; "
        "-1: never mid-run; None: --save_steps decides)", None)
    eval_rollouts: int | None = doc(
        "GRPO: evaluate every N rollouts, as --save_rollouts sets --eval_steps (OpenRLHF's "
        "--eval.steps; -1: only at the end; None: --eval_steps decides)", None)
    micro_rollout_batch_size: int | None = doc(
        "GRPO: completions per forward of the experience stage on each rank (the reference's "
        "and the sampling policy's log-probs, PPO's values), apart from training's "
        "micro_train_batch_size (OpenRLHF's --rollout.micro_batch_size; None: the training "
        "micro-batches)", None)
    dynamic_batch: bool = doc(
        "GRPO: micro-batches by a token budget (--max_tokens_per_gpu) instead of "
        "--micro_train_batch_size rows: each optimizer step's completions on a rank cut, in "
        "order, into as few micro-batches as fit the budget, every rank into the most any needs "
        "(OpenRLHF's --train.dynamic_batch_enable); with loss_weighting step the update equals "
        "the row-count run's", False)
    max_tokens_per_gpu: int = doc(
        "GRPO: --dynamic_batch's budget: tokens a training forward holds (its rows' lengths "
        "with --packing_samples, rows x the longest otherwise); a longer completion trains "
        "alone (OpenRLHF's --train.max_tokens_per_gpu)", 16192)
    rollout_max_tokens_per_gpu: int | None = doc(
        "GRPO: with --dynamic_batch, the experience forwards' budget, in place of "
        "--micro_rollout_batch_size (OpenRLHF's --rollout.max_tokens_per_gpu; None: "
        "--max_tokens_per_gpu)", None)
    max_new_tokens: int = doc("GRPO: longest completion in tokens", 64)
    temperature: float = doc("GRPO: sampling temperature", 1.0)
    top_p: float = doc("GRPO: nucleus sampling mass (< 1: samples from the head, while the "
                       "log-probs stay those of the whole distribution, as in TRL)", 1.0)
    top_k: int = doc("GRPO: sample among the k likeliest tokens (0: all; > 0: the log-probs "
                     "stay those of the whole distribution, as in TRL)", 0)
    eval_temperature: float = doc(
        "GRPO: held-out prompts sampled at this temperature (with --top_p/--top_k), "
        "--eval_n_samples each (0: greedy, one each; OpenRLHF's --eval.temperature)", 0.0)
    eval_n_samples: int = doc(
        "GRPO: completions per held-out prompt when sampled: pass1 (their mean reward) and "
        "pass<k> (each prompt's best, averaged) logged (OpenRLHF's --eval.n_samples_per_prompt)",
        1)
    advantage_eps: float = doc("GRPO: added to a group's reward std before dividing", 1e-4)
    advantage_estimator: str = doc(
        "GRPO: advantages from outcome rewards (OpenRLHF's meanings): group_norm (GRPO: less the "
        "group mean, over its std), dr_grpo (less the group mean), rloo (less the mean of the "
        "group's others), reinforce (the reward, whitened over the rollout's tokens) or "
        "reinforce_baseline (less the group mean, whitened)", "group_norm")
    policy_loss_type: str = doc(
        "GRPO/PPO: ppo (each token's ratio clipped, today's loss), gspo (each completion's "
        "ratio, exp of its mean token log-ratio, clipped: GSPO, OpenRLHF's gspo, TRL's "
        "importance_sampling_level=sequence) or cispo (-sg(min(ratio, 1 + clip_eps_high)) x "
        "advantage x logp: the weight clipped, every token keeps a gradient; TRL's cispo with "
        "epsilon_high = 1 + clip_eps_high, e.g. 4.0 for its 5.0)", "ppo")
    policy_loss_agg: str | None = doc(
        "GRPO: how token losses make the step's loss: token_mean (every completion token of the "
        "step weighs the same; TRL's dapo), seq_mean_token_mean (each completion's token mean, "
        "averaged over completions: the GRPO paper) or seq_mean_token_sum_norm (each "
        "completion's token sum over max_new_tokens, averaged: Dr. GRPO); None: token_mean, "
        "gspo's seq_mean_token_mean (GSPO's mean over sequences, as OpenRLHF forces it)", None)
    clip_eps_low: float | None = doc("GRPO: lower ratio clip, 1 - eps (None: --clip_eps)", None)
    clip_eps_high: float | None = doc("GRPO: upper ratio clip, 1 + eps (None: --clip_eps; DAPO's "
                                      "clip-higher: e.g. 0.28)", None)
    dual_clip: float | None = doc("GRPO: dual-clip PPO bound (> 1) on a negative advantage's "
                                  "loss, -dual_clip x advantage (None: off)", None)
    kl_in_reward: bool = doc(
        "GRPO: put kl_coef x the KL estimate (--kl_estimator; k1 is OpenRLHF's default) into each "
        "completion token's reward, advantages then being per-token returns, instead of a KL term "
        "in the loss (OpenRLHF's PPO/REINFORCE++ way)", False)
    rollout_gather: str = doc(
        "GRPO under ZeRO-3: full (gather the policy once per rollout into a plain copy that "
        "generates without collectives; refused when it would not fit in a rank's free memory) "
        "or layer (DeepSpeed's partitioned forward: one gather per layer per generated token)",
        "full")
    kl_estimator: str = doc("GRPO: the KL penalty's estimator: k1 (logp - ref), k2 ((logp - "
                            "ref)^2 / 2) or k3 (exp(ref - logp) - (ref - logp) - 1)", "k3")
    shared_prompt_forward: bool | None = doc(
        "GRPO/PPO: the update's forwards (policy, reference, critic) run each distinct prompt of "
        "a micro-batch once and its completions on that prompt's KV cache, not prompt + "
        "completion per row: the same log-probs to float rounding, 1/group_size of the prompt's "
        "work, two forward calls per micro-batch (None: on below ZeRO-3, off at ZeRO-3, where "
        "every forward call gathers the weights; --packing_samples forwards padding-free rows "
        "instead; a model under gradient checkpointing or without transformers' plain dynamic "
        "cache forwards per row)", None)
    overlong_buffer_len: float | None = doc(
        "GRPO/PPO: DAPO's soft overlong punishment: a completion longer than max_new_tokens less "
        "this many tokens loses overlong_penalty_factor x its excess (at most this) / this from "
        "its reward (OpenRLHF's --reward.overlong_buffer_len; None: off)", None)
    overlong_penalty_factor: float = doc("GRPO/PPO: the largest overlong penalty", 1.0)
    stop_properly_penalty_coef: float | None = doc(
        "GRPO/PPO: a completion cut at max_new_tokens without its end token gets its reward "
        "times this (in [0, 1]), or this value when negative, e.g. -0.5 (ProRL; OpenRLHF's "
        "--reward.stop_properly_penalty_coef; None: off); after the overlong penalty", None)
    mask_truncated_completions: bool = doc(
        "GRPO/PPO: completions cut at max_new_tokens train nothing (no loss, KL or value loss; "
        "not counted in the token means) while their rewards still count in their group's "
        "baseline (TRL's mask_truncated_completions)", False)
    dynamic_filtering: bool = doc(
        "GRPO/PPO: DAPO's dynamic sampling: a group whose mean reward (the reward's own, before "
        "length shaping) is not strictly inside --dynamic_filtering_range is dropped and more "
        "prompts are sampled until the step's train_batch_size completions are full (OpenRLHF's "
        "--algo.dynamic_filtering_enable); the step count stays as planned, the extra prompts "
        "come from the data's next shuffles", False)
    dynamic_filtering_range: tuple[float, float] = doc(
        "GRPO/PPO: LO HI: groups whose mean reward r has LO < r < HI are kept", (0.0, 1.0))
    max_sampling_rounds: int = doc(
        "GRPO/PPO: with --dynamic_filtering, at most this many rounds of prompts per step; "
        "short of a full step then, it trains on the kept groups (the rest is masked filler, "
        "logged as filler_groups)", 10)
    gamma: float = doc("GRPO/PPO: discount of per-token returns (< 1: each token's advantage is "
                       "its discounted return, the outcome on the last token; OpenRLHF's gamma)",
                       1.0)
    agent_func_path: str | None = doc(
        "GRPO/PPO: multi-turn episodes: a Python file whose class AgentInstance (OpenRLHF's "
        "agent interface, strategy.agents) answers each model turn with feedback, a reward and "
        "done; the feedback is context only (no loss). Its rewards replace --reward_fn "
        "(OpenRLHF's --train.agent_func_path; None: one completion per prompt)", None)
    max_turns: int = doc("GRPO/PPO with --agent_func_path or --tools: model turns per episode "
                         "at most "
                         "(each at most --max_new_tokens; prompt, turns and feedback at most "
                         "--max_len)", 8)
    agent_timeout: float = doc("GRPO/PPO with --agent_func_path or --tools: seconds one turn's "
                               "environment calls (reset, step) may take before every rank stops "
                               "with a line naming the episode (0: no limit)", 300.0)
    tools: str | None = doc(
        "GRPO/PPO: tools 'module:name' (a list of functions with type hints and Args: "
        "docstrings): their schemas go into every prompt's chat template, a tool call in the "
        "model's turn is run and its result appended as the template's tool turn (context only), "
        "until a turn without one, which --reward_fn scores (None: no tools)", None)
    tool_timeout: float = doc("GRPO/PPO with --tools: seconds one tool call may take before its "
                              "result is an error the model sees (0: no limit)", 10.0)

    estimators = OUTCOME_ESTIMATORS  # what this config's trainer can estimate without a critic

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """The ratio's clip range below and above 1 (``clip_eps_low``/``high``, else
        ``clip_eps``)."""
        low, high = self.clip_eps_low, self.clip_eps_high
        return (self.clip_eps if low is None else low, self.clip_eps if high is None else high)

    def updates_per_rollout(self, train_batch_size: int) -> int:
        """Optimizer steps per rollout: ``ppo_epochs`` passes, each of the rollout's
        completions over ``train_batch_size`` steps.

        Args:
            train_batch_size: completions per optimizer step (all ranks).

        Returns:
            The steps one rollout trains for.
        """
        if self.rollout_batch_size is None:
            return self.ppo_epochs
        return self.ppo_epochs * max(
            self.rollout_batch_size * self.group_size // train_batch_size, 1)

    @property
    def per_token(self) -> bool:
        """Whether advantages are per token (a KL in the reward, a discount, or GAE) rather
        than one per completion."""
        return self.kl_in_reward or self.gamma < 1 or self.advantage_estimator == "gae"

    def _check_agent(self) -> None:
        """Multi-turn episodes' settings, and what they cannot run with."""
        check_positive(self, "max_turns")
        for name in ("agent_timeout", "tool_timeout"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "use seconds > 0, or 0 for no limit")
        if self.agent_func_path is not None and self.tools is not None:
            fail("tools", self.tools, "an agent file is the environment itself; drop --tools or "
                 "--agent_func_path")
        if self.agent_func_path is not None:
            for name in ("reward_fn", "reward_pretrain", "remote_rm_url"):
                if getattr(self, name) is not None:
                    fail(name, getattr(self, name), "the environment's step returns the rewards "
                         f"with --agent_func_path; unset it (--{name} none) or drop that")
        if not self.episodic:
            return
        for name in ("overlong_buffer_len", "stop_properly_penalty_coef"):
            if getattr(self, name) is not None:
                fail(name, getattr(self, name), "it shapes one completion's length; an episode's "
                     "environment rewards its turns: drop it with --agent_func_path or --tools")

    @property
    def episodic(self) -> bool:
        """Whether rollouts are multi-turn episodes (an agent file or tools)."""
        return self.agent_func_path is not None or self.tools is not None

    def _check_length_shaping(self) -> None:
        """The length penalties' ranges (OpenRLHF's asserts, as one-line refusals)."""
        buffer = self.overlong_buffer_len
        if buffer is not None and not 0 < buffer <= self.max_new_tokens:
            fail("overlong_buffer_len", buffer, f"use 1 to max_new_tokens={self.max_new_tokens} "
                 "tokens")
        if self.overlong_penalty_factor < 0:
            fail("overlong_penalty_factor", self.overlong_penalty_factor, "use a penalty >= 0")
        coef = self.stop_properly_penalty_coef
        if coef is not None and coef > 1:
            fail("stop_properly_penalty_coef", coef, "use a factor in [0, 1], or a negative "
                 "reward for cut completions, e.g. -0.5")

    def _check_dynamic_filtering(self) -> None:
        """The filter's range and rounds (OpenRLHF's asserts, as one-line refusals)."""
        low, high = self.dynamic_filtering_range
        if not low < high:
            fail("dynamic_filtering_range", f"{low} {high}", "give LO < HI, e.g. 0 1")
        if self.max_sampling_rounds < 1:
            fail("max_sampling_rounds", self.max_sampling_rounds, "use at least 1 round, e.g. 10")
        if self.dynamic_filtering and self.group_size < 2:
            fail("dynamic_filtering", True, "it filters groups by their mean reward; use "
                 "--group_size 2 or more")

    def _check_policy_loss(self) -> None:
        """The loss type's own refusals; ``policy_loss_agg`` resolved from it when unset."""
        kind = self.policy_loss_type
        if kind not in POLICY_LOSS_TYPES:
            fail("policy_loss_type", kind, f"use one of {', '.join(POLICY_LOSS_TYPES)}")
        if self.policy_loss_agg is None:
            object.__setattr__(self, "policy_loss_agg",
                               "seq_mean_token_mean" if kind == "gspo" else "token_mean")
        if kind == "gspo" and self.policy_loss_agg != "seq_mean_token_mean":
            fail("policy_loss_agg", self.policy_loss_agg, "GSPO's objective is a mean over "
                 "completions of their sequence-level terms; use seq_mean_token_mean (the "
                 "default with gspo)")
        if kind == "cispo" and self.dual_clip is not None:
            fail("dual_clip", self.dual_clip, "CISPO clips the weight, not the objective; drop "
                 "it, or use --policy_loss_type ppo")
        if kind == "cispo" and self.clip_eps_low is not None:
            fail("clip_eps_low", self.clip_eps_low, "CISPO clips the weight above only "
                 "(1 + clip_eps_high); drop it")

    def reward_names(self) -> list[str]:
        """Each reward in weight order.

        Returns:
            The ``reward_fn`` specs, then ``"model"`` with ``reward_pretrain``, then
            ``"remote"`` with ``remote_rm_url``.
        """
        specs = [part.strip() for part in (self.reward_fn or "").split(",") if part.strip()]
        return specs + (["model"] if self.reward_pretrain else []) + (
            ["remote"] if self.remote_rm_url else [])

    def weights(self) -> list[float]:
        """``reward_weights`` as floats.

        Returns:
            One weight per reward, in ``reward_names`` order (default 1 each).

        Raises:
            ConfigError: not numbers, or not one per reward.
        """
        count = len(self.reward_names())
        if self.reward_weights is None:
            return [1.0] * count
        try:
            weights = [float(w) for w in self.reward_weights.split(",")]
        except ValueError:
            fail("reward_weights", self.reward_weights, "write numbers separated by commas, "
                 "e.g. 1.0,0.5")
        if len(weights) != count or not all(math.isfinite(w) for w in weights):
            fail("reward_weights", self.reward_weights, f"give one finite weight per reward: "
                 f"{count} ({', '.join(self.reward_names())})")
        return weights

    def _check_eval_sampling(self) -> None:
        check_positive(self, "eval_n_samples")
        if self.eval_temperature < 0:
            fail("eval_temperature", self.eval_temperature, "use a temperature > 0, or 0 for "
                 "greedy")
        if self.eval_n_samples > 1 and self.eval_temperature == 0:
            fail("eval_n_samples", self.eval_n_samples, "greedy completions of one prompt are "
                 "all alike; add --eval_temperature T (OpenRLHF's default 0.6) or use 1")
        if self.eval_temperature > 0 and self.episodic:
            fail("eval_temperature", self.eval_temperature, "held-out episodes are played "
                 "greedily here; use 0 with --agent_func_path or --tools")

    def _check_normalize_reward(self) -> None:
        """--normalize_reward needs a reward model whose config.json holds its scale (read here
        where it is a local directory, before anything loads; a Hub id's at its load)."""
        if not self.normalize_reward or self.reward_pretrain is None:
            return
        saved = os.path.join(self.reward_pretrain, "config.json")
        if os.path.isfile(saved):
            with open(saved) as f:
                saved_reward_scale(self.reward_pretrain, json.load(f))

    def __post_init__(self) -> None:
        check_positive(self, "group_size", "ppo_epochs", "max_new_tokens")
        for name in ("rollout_batch_size", "micro_rollout_batch_size", "max_tokens_per_gpu",
                     "rollout_max_tokens_per_gpu"):
            if getattr(self, name) is not None:
                check_positive(self, name)
        check_steps(self, *(name for name in ("save_rollouts", "eval_rollouts")
                            if getattr(self, name) is not None), unit="rollouts")
        self._check_eval_sampling()
        if self.reward_fn is None and self.reward_pretrain is None \
                and self.remote_rm_url is None and self.agent_func_path is None:
            fail("reward_fn", None, "name a reward: --reward_fn module:function, "
                 "--reward_pretrain RM_DIR or --remote_rm_url FILE.py|URL (or an environment: "
                 "--agent_func_path FILE)")
        self._check_agent()
        self._check_normalize_reward()
        if self.reward_weights is not None:
            self.weights()
        if self.reward_timeout < 0:
            fail("reward_timeout", self.reward_timeout, "use seconds > 0, or 0 for no limit")
        if self.kl_coef < 0:
            fail("kl_coef", self.kl_coef, "use a weight >= 0, e.g. 0.04")
        if not 0 < self.clip_eps < 1:
            fail("clip_eps", self.clip_eps, "use a value in (0, 1), e.g. 0.2")
        if self.clip_eps_low is not None and not 0 < self.clip_eps_low < 1:
            fail("clip_eps_low", self.clip_eps_low, "use a value in (0, 1), e.g. 0.2")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            fail("clip_eps_high", self.clip_eps_high, "use a positive value, e.g. 0.28")
        if self.dual_clip is not None and not self.dual_clip > 1:
            fail("dual_clip", self.dual_clip, "use a bound > 1, e.g. 3.0, or leave it unset")
        if self.advantage_estimator == "gae" and "gae" not in self.estimators:
            fail("advantage_estimator", "gae", "GAE needs a value model (a critic), which GRPO "
                 f"has none of; train with strategy ppo, or use one of "
                 f"{', '.join(OUTCOME_ESTIMATORS)}")
        if not 0 < self.gamma <= 1:
            fail("gamma", self.gamma, "use a discount in (0, 1], e.g. 1.0")
        self._check_policy_loss()
        self._check_length_shaping()
        self._check_dynamic_filtering()
        for name, allowed in (("advantage_estimator", self.estimators),
                              ("policy_loss_agg", POLICY_LOSS_AGGS),
                              ("kl_estimator", KL_ESTIMATORS),
                              ("rollout_gather", GATHER_MODES)):
            if getattr(self, name) not in allowed:
                fail(name, getattr(self, name), f"use one of {', '.join(allowed)}")
        if self.group_size < 2 and self.advantage_estimator in GROUPED:
            fail("group_size", self.group_size, f"{self.advantage_estimator} compares completions "
                 "within a group; use at least 2, e.g. 8 (or --advantage_estimator reinforce)")
        check_sampling(self)


@dataclass(frozen=True)
class PPOConfig(GRPOConfig):
    """PPO with a critic: GRPO's sampling, rewards and clipped update, advantages from GAE over a
    value model trained beside the policy. Defaults follow OpenRLHF's PPO: one completion per
    prompt, a k1 KL in the reward."""

    group_size: int = doc("PPO: completions sampled per prompt; train_batch_size counts "
                          "completions", 1)
    advantage_estimator: str = doc("PPO: gae (advantages from the critic's values, "
                                   "--gamma/--lambd)", "gae")
    kl_in_reward: bool = doc("PPO: the KL (kl_coef x --kl_estimator) goes into each token's "
                             "reward (OpenRLHF's default) instead of the loss", True)
    kl_estimator: str = doc("PPO: the KL's estimator: k1, k2 or k3", "k1")
    kl_coef: float = doc("PPO: weight of the KL to the reference (OpenRLHF's init_kl_coef)", 0.01)
    lambd: float = doc("PPO: GAE's lambda (OpenRLHF's --lambd)", 0.95)
    value_clip: float | None = doc("PPO: clip the critic's new values to old +- this in its loss "
                                   "(OpenRLHF's --value_clip; None: no clipping)", 0.5)
    critic_pretrain: str | None = doc("PPO: the critic's start, a model directory (default "
                                      "--reward_pretrain, else --pretrain); its value head is "
                                      "the checkpoint's 1-label score head or a new one", None)
    critic_learning_rate: float = doc("PPO: the critic's peak learning rate (its own Adam and "
                                      "schedule)", 9e-6)
    save_value_network: bool = doc("PPO: also export the critic to <save_path>_critic", False)
    critic_zero_stage: int | None = doc("PPO: the critic's ZeRO stage (None: --zero_stage)", None)
    critic_adam_offload: bool | None = doc("PPO: keep the critic's optimizer states on CPU "
                                           "(None: --adam_offload)", None)

    estimators = ("gae",)

    def critic_settings(self) -> dict:
        """The critic's own ``StrategyConfig`` changes (for ``DeepSpeedStrategy.derive``).

        Returns:
            ``zero_stage`` and ``adam_offload`` where set.
        """
        out = {"zero_stage": self.critic_zero_stage, "adam_offload": self.critic_adam_offload}
        return {k: v for k, v in out.items() if v is not None}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lambd <= 1:
            fail("lambd", self.lambd, "use a GAE lambda in [0, 1], e.g. 0.95")
        if self.value_clip is not None and self.value_clip <= 0:
            fail("value_clip", self.value_clip, "use a positive range, e.g. 0.5, or leave it unset")
        positive(self, "critic_learning_rate")


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (GKD): the student learns the teacher's next-token distribution on
    its own samples (a ``lmbda`` share of the steps) or on the dataset's completions."""

    teacher_pretrain: str | None = doc("distill: the teacher, a model directory of the student's "
                                       "tokenizer (required)", None)
    teacher_offload: bool = doc("distill: keep the teacher off the accelerator between uses "
                                "(ZeRO-3, parameters on CPU), whatever the student's stage",
                                False)
    lmbda: float = doc("distill: the share of optimizer steps trained on the student's own "
                       "samples of the prompts (TRL's lmbda; 0: plain KD on the dataset's "
                       "completions, 1: every step on-policy)", 0.5)
    beta: float = doc("distill: the generalized JSD's mix: 0 forward KL(teacher || student), 1 "
                      "reverse KL(student || teacher) (on-policy distillation), between: the "
                      "JSD of that mixture (TRL's beta)", 0.5)
    max_new_tokens: int = doc("distill: longest on-policy completion in tokens", 64)
    temperature: float = doc("distill: on-policy sampling temperature (TRL's default 0.9)", 0.9)
    top_p: float = doc("distill: on-policy nucleus sampling mass", 1.0)
    top_k: int = doc("distill: on-policy sampling among the k likeliest tokens (0: all)", 0)
    rollout_gather: str = doc("distill under ZeRO-3: full (one gathered copy per step "
                              "generates) or layer (DeepSpeed's partitioned forward)", "full")
    eval_exact_match: bool = doc("distill: held-out greedy completions against the dataset's "
                                 "(exact_match), beside the held-out divergence", True)

    def __post_init__(self) -> None:
        check_positive(self, "max_new_tokens")
        for name in ("lmbda", "beta"):
            if not 0 <= getattr(self, name) <= 1:
                fail(name, getattr(self, name), "use a value in [0, 1], e.g. 0.5")
        check_sampling(self)
        if self.rollout_gather not in GATHER_MODES:
            fail("rollout_gather", self.rollout_gather, f"use one of {', '.join(GATHER_MODES)}")
