"""PPO with a critic, on GRPO's experience stage (``grpo.GRPOTrainer.rollout``).

A rollout samples ``group_size`` completions per prompt (1 by default, as OpenRLHF's PPO), scores
them, and takes the reference's log-probs, as GRPO does; then the critic (a value head on a
Hugging Face backbone, ``AutoModelForTokenClassification`` with one label) values the state before
each completion token. Each token's reward is ``-kl_coef`` x the KL to the reference
(``--kl_in_reward``, k1, OpenRLHF's default) plus the completion's reward on its last token; GAE
(``--gamma``, ``--lambd``) turns rewards and values into advantages (whitened over every rank's
completion tokens, as OpenRLHF) and returns. Every optimizer step trains both engines: the policy
on GRPO's clipped loss, the critic on ``0.5 x (value - return)^2``, its new value clipped to
the rollout's value ``+- value_clip`` (OpenRLHF's ``ValueLoss``), both aggregated by
``--policy_loss_agg``.

The critic is its own engine (``trained_engines``): its own Adam at ``--critic_learning_rate``
and its own schedule, at the run's ZeRO stage and offload or its own (``--critic_zero_stage``,
``--critic_adam_offload``: ``critic_strategy``, a ``DeepSpeedStrategy.derive`` of the run's).
Checkpoints hold policy and critic (``<ckpt_path>`` and ``<ckpt_path>_critic``, one tag), so a
resume is exact; the export writes the policy, and the critic to ``<save_path>_critic`` with
``--save_value_network``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForTokenClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

from strategy.config import StrategyConfig
from strategy.config.cluster import ClusterConfig
from strategy.errors import ConfigError, fail
from strategy.model import hf_config
from strategy.rollout.config import RolloutConfig
from strategy.rollout.remote_models import RemoteCritic, remote_group
from strategy.trainers.algorithms.grpo import GRPOTrainer
from strategy.trainers.config import ModelConfig, PPOConfig
from strategy.trainers.losses import gae, token_values, value_token_losses

CRITIC = "critic"  # the critic's engine name: checkpoints <ckpt_path>_critic, export <path>_critic


def critic_source(ppo: PPOConfig, model: ModelConfig) -> str | None:
    """Where the critic starts: ``--critic_pretrain``, else the reward model, else the policy's
    ``--pretrain`` (OpenRLHF's order); None: a fresh model from ``--model_config``."""
    return ppo.critic_pretrain or ppo.reward_pretrain or model.pretrain


def critic_strategy(strategy, ppo: PPOConfig):
    """The strategy the critic is built, optimized and prepared with: ``strategy`` itself, or a
    ``derive`` of it with ``--critic_zero_stage`` / ``--critic_adam_offload``."""
    settings = ppo.critic_settings()
    return strategy.derive(**settings) if settings else strategy


def build_critic(run: Any, ppo: PPOConfig):
    """PPO's value model: ``AutoModelForTokenClassification`` with one label and no dropout or
    bias on its head (OpenRLHF's critic head), from ``critic_source`` (a reward model's ``score``
    head loads as it is; a causal LM gets a new one), or fresh from ``--model_config``;
    partitioned at construction when its own stage (``--critic_zero_stage``) is 3.

    Args:
        run: the ``Run`` (strategy, model config, tokenizer, attention settings).
        ppo: the ``PPOConfig``.

    Returns:
        The critic (not yet an engine: ``PPOTrainer`` prepares it); in a Ray job whose critic
        has a group of its own, that group (``RemoteCritic``).
    """
    remote = remote_group(CRITIC)
    if remote is not None:
        return remote
    source = critic_source(ppo, run.model_cfg)
    if source is None:
        config = hf_config(run.model_cfg.model_config, run.tokenizer, num_labels=1)
    else:
        config = AutoConfig.from_pretrained(source, num_labels=1)
    config.classifier_dropout, config.token_classification_bias = 0.0, False
    kwargs = {} if source is None else {"config": config}
    model = critic_strategy(run.strategy, ppo).from_pretrained(
        source or config, AutoModelForTokenClassification, **run.attention(), **kwargs)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = run.tokenizer.pad_token_id
    return model


def critic_scale(ppo: PPOConfig, saved: Any) -> tuple[float, float]:
    """The (mean, std) PPO's critic values are scaled by, ``(value - mean) / std``: under
    ``--normalize_reward`` those its start's config holds (a reward model's, as OpenRLHF's critic
    scales them); (0, 1) otherwise, or where its config holds none."""
    mean, std = getattr(saved, "mean", None), getattr(saved, "std", None)
    if not ppo.normalize_reward or mean is None or not std:
        return 0.0, 1.0
    return float(mean), float(std)


def check_critic(ppo: PPOConfig, model: ModelConfig, run: StrategyConfig) -> None:
    """The critic's own ZeRO settings are valid, and its start can carry a 1-label value head,
    before any process group starts.

    Raises:
        ConfigError: a bad ``critic_*`` setting, a model type with no token-classification class
            in transformers, or a checkpoint holding a classification head of another label
            count.
    """
    try:
        dataclasses.replace(run, **ppo.critic_settings())
    except ConfigError as error:  # StrategyConfig names its own flags: the critic's are meant
        message = f"critic_{error}"
        for flag in ("--zero_stage", "--adam_offload"):
            message = message.replace(flag, flag.replace("--", "--critic_"))
        raise ConfigError(message) from None
    source = critic_source(ppo, model)
    name = ("critic_pretrain" if ppo.critic_pretrain else
            "reward_pretrain" if ppo.reward_pretrain else "pretrain")  # where source came from
    if source is None:
        with open(model.model_config) as fh:
            kind, heads, labels = json.load(fh).get("model_type"), [], 1
    else:
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError):  # no such directory, or no model config in it
            fail(name, source, "the critic starts from it, but it holds no model config.json; "
                 "pass a model directory (an SFT or reward model export) as --critic_pretrain")
        kind, labels = config.model_type, config.num_labels
        heads = [a for a in config.architectures or [] if a.endswith("Classification")]
    if kind not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        fail(name, source or model.model_config, f"a {kind} model has no value-head class in "
             "transformers (no ...ForTokenClassification); start the critic from a llama, qwen2, "
             "mistral or gpt2-style checkpoint with --critic_pretrain")
    if heads and labels != 1:
        fail(name, source, f"its {heads[0]} head has {labels} labels; a critic needs a 1-label "
             "value head: pass a reward model or a causal LM as --critic_pretrain")


class PPOTrainer(GRPOTrainer):
    """The policy and a critic trained together on GRPO's rollouts, advantages by GAE.

    Built on the public ``Trainer`` hooks and GRPO's: ``advantages`` values the rollout and
    runs GAE, ``compute_loss`` returns a loss per engine, ``trained_engines`` adds the critic,
    ``exported_engines`` leaves it out unless ``save_value_network``.

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy.
        optimizer: the policy's optimizer.
        scheduler: its schedule.
        train_dataloader: the prompt loader (``PROMPTS``).
        eval_dataloader: held-out prompts, or None.
        config: the ``TrainConfig``.
        tokenizer: decodes completions.
        grpo: the ``PPOConfig`` (required).
        ref_model: the frozen reference (required when ``kl_coef`` > 0).
        reward: ``reward(prompts, completions, rows) -> floats`` (required).
        critic: the value model (``Run.critic()``: ``AutoModelForTokenClassification``, 1
            label), given its own optimizer and schedule here.
        answer_key: the row key of the reference answer for eval ``exact_match``.
        packing: padding-free update forwards, as ``GRPOTrainer``'s.
        rollout: the ``RolloutConfig``, as ``GRPOTrainer``'s.
        max_len: an episode's longest context, as ``GRPOTrainer``'s.

    Raises:
        ConfigError: no critic, or ``grpo`` is not a ``PPOConfig``.
    """

    config_classes = (PPOConfig, RolloutConfig, ClusterConfig)
    command = "ppo"

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        """GRPO's refusals, and a critic start that can carry a value head.

        Args:
            configs: the parsed configs by class.
            world_size: ranks the launcher started.

        Raises:
            ConfigError: a setting PPO cannot run with.
        """
        super().check_settings(configs, world_size)
        check_critic(configs[PPOConfig], configs[ModelConfig], configs[StrategyConfig])

    def __init__(self, strategy, model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None, grpo: PPOConfig | None = None,
                 ref_model=None, reward=None, critic=None, answer_key: str | None = "output",
                 packing: bool = False, rollout: RolloutConfig | None = None,
                 max_len: int | None = None) -> None:
        if not isinstance(grpo, PPOConfig) or critic is None:
            fail("critic", critic, "PPOTrainer needs grpo=PPOConfig(...) and critic=<a value "
                 "model> (Run.critic())")
        self.remote_critic = isinstance(critic, RemoteCritic)  # trained by its Ray group
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader,
                         eval_dataloader, config, tokenizer, grpo=grpo, ref_model=ref_model,
                         reward=reward, answer_key=answer_key, packing=packing,
                         rollout=rollout, max_len=max_len)
        if self.remote_critic:
            self.value_scale, self.critic = critic.prepare(self.total_steps()), critic
            return
        own = critic_strategy(strategy, grpo)  # the critic's ZeRO stage and offload
        critic_optimizer = own.create_optimizer(critic, lr=grpo.critic_learning_rate)
        schedule = own.create_scheduler(critic_optimizer,
                                        num_training_steps=max(self.total_steps(), 1))
        self.value_scale = critic_scale(grpo, critic.config)
        self.critic = own.prepare((critic, critic_optimizer, schedule))

    def values(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's values of a batch, scaled as ``value_scale`` says (``--normalize_reward``
        with a start whose config.json holds a mean and std: ``(value - mean) / std``).

        Args:
            batch: a rollout micro-batch on the device.

        Returns:
            ``(values, mask)``: each scored token's value (0 elsewhere), and the mask of scored
            tokens (``token_values``' layout).
        """
        if self.remote_critic:
            values, mask = self.critic.values(batch)
        else:
            values, mask = token_values(self.critic, batch)
        mean, std = self.value_scale
        return (values - mean) / std * mask, mask

    def trained_engines(self) -> dict[str, Any]:
        if self.remote_critic:  # its group trains it (compute_loss sends it its gradient)
            return super().trained_engines()
        return {**super().trained_engines(), CRITIC: self.critic}

    def sleep_trained(self) -> None:
        super().sleep_trained()
        if self.remote_critic:  # its group's ranks sleep it (with --ds_enable_sleep there)
            self.critic.sleep()

    def accumulation_boundary(self, last: bool) -> None:
        """As ``Trainer.accumulation_boundary``; a critic in a Ray group of its own is told with
        the micro-batch's gradient (its group steps after the step's last).

        Args:
            last: the next micro-batch is the step's last.
        """
        super().accumulation_boundary(last)
        if self.remote_critic:
            self.critic.last = last

    def exported_engines(self) -> dict[str, Any]:
        engines = {**self.trained_engines(), CRITIC: self.critic}
        if not self.grpo.save_value_network:
            engines.pop(CRITIC)
        return engines

    def save_model(self, path: str, ema=None, engine=None) -> None:
        """As ``Trainer.save_model``; a critic in a Ray group of its own is exported by it.

        Args:
            path: the output directory.
            ema: the moving average to export instead of the current weights.
            engine: the engine to export (default ``self.model``), or the critic.
        """
        if engine is self.critic and self.remote_critic:
            self.critic.save_model(path, self.cfg.max_shard_size)
            return
        super().save_model(path, ema=ema, engine=engine)

    def save_checkpoint(self) -> None:
        """As ``Trainer.save_checkpoint``; a critic in a Ray group of its own is saved by it,
        to ``<ckpt_path>_critic`` with the same tag and metric."""
        super().save_checkpoint()
        if self.remote_critic and not self.cfg.disable_ds_ckpt:
            ckpt = self.strategy.checkpoint
            step, metrics = self.last_eval
            metric = (metrics.get(ckpt.best_metric) if ckpt.keep_best_ckpt
                      and step == self.global_step else None)
            self.critic.save_ckpt(f"{ckpt.ckpt_path.rstrip('/')}_{CRITIC}",
                                  f"global_step{self.global_step}", metric)

    def load_checkpoint_state(self, state: dict) -> None:
        """As GRPO's; a critic in a Ray group of its own loads its checkpoint of this step.

        Args:
            state: the trainer state ``checkpoint_state`` saved.
        """
        super().load_checkpoint_state(state)
        if self.remote_critic:
            ckpt_path = self.strategy.checkpoint.ckpt_path.rstrip("/")
            self.critic.load_ckpt(f"{ckpt_path}_{CRITIC}", f"global_step{self.global_step}")

    def advantages(self, batches: list[dict]) -> None:
        """The critic's values of the rollout (``old_values``), then GAE over the per-token
        rewards: ``advantages`` (whitened over every rank's tokens) and ``returns``.

        Args:
            batches: the rollout's micro-batches, set in place.
        """
        def forward(parts: list[dict]) -> list[torch.Tensor]:
            with torch.no_grad():
                return [self.values(self.to_device(b))[0].cpu() for b in parts]

        for b, values in zip(batches, self.experience_forwards(batches, forward)):
            b["old_values"] = values
        rewards = torch.cat([b["rewards"] for b in batches])
        self.token_advantages(batches, rewards, self._gae)

    def _gae(self, rewards: torch.Tensor, mask: torch.Tensor, batch: dict) -> torch.Tensor:
        advantages, batch["returns"] = gae(rewards, batch["old_values"], mask, self.grpo.gamma,
                                           self.grpo.lambd)
        return advantages

    def compute_loss(self, batch: dict) -> tuple[dict, dict]:
        """The policy's clipped loss (GRPO's) and the critic's clipped value loss.

        Args:
            batch: a rollout micro-batch on the device.

        Returns:
            ``({"model": policy loss, "critic": value loss}, metrics)``.
        """
        policy, metrics = super().compute_loss(batch)
        values, mask = self.values(batch)
        mask = self.trained_mask(batch, mask)
        losses, value_metrics = value_token_losses(values, batch["old_values"], batch["returns"],
                                                   mask, self.grpo.value_clip)
        value_loss = self.aggregate(losses, mask)
        if self.remote_critic:  # backpropagated and stepped by the critic's group; logged here
            self.critic.backward(value_loss)
            value_loss = value_loss.detach()
        return {"model": policy, CRITIC: value_loss}, {**metrics, **value_metrics}
