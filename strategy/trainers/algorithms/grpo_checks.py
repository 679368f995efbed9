"""GRPO's (and PPO's) settings checks, before any process group: each refusal one line naming
the setting and the fix (``GRPOTrainer.check_settings`` runs them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from strategy.agents import load_agent
from strategy.config import StrategyConfig
from strategy.config.cluster import ClusterConfig
from strategy.engines import check_sleep
from strategy.errors import fail
from strategy.optim import OptimConfig
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_checks import check_vllm_settings
from strategy.tools import load_tools
from strategy.trainers.algorithms.remote_reward import check_remote
from strategy.trainers.algorithms.rewards import load_reward_fn
from strategy.trainers.config import DataConfig, GRPOConfig, ModelConfig, TrainConfig
from strategy.trainers.data.spec import prompts_per_rank


def check_grpo_settings(configs: dict, config_class: type, world_size: int) -> None:
    """Every refusal of GRPO's (``config_class``: its config, or PPO's), and ``configs``'
    ``TrainConfig`` with rollout-counted cadences as steps (``rollout_counted``).

    Args:
        configs: the parsed configs by class.
        config_class: the trainer's own config class.
        world_size: ranks the launcher started.

    Raises:
        ConfigError: a setting GRPO cannot run with.
    """
    grpo, model = configs[config_class], configs[ModelConfig]
    if configs[DataConfig].streaming:
        fail("streaming", True, "GRPO's prompts are read whole; drop --streaming")
    if configs[DataConfig].pack_dataset:
        fail("pack_dataset", True, "prompts are not packed; --packing_samples forwards the "
             "update's micro-batches padding-free")
    configs[TrainConfig] = rollout_counted(configs[TrainConfig], grpo,
                                           configs[StrategyConfig].train_batch_size)
    check_grpo(configs[StrategyConfig], configs[TrainConfig], grpo,
               configs[DataConfig].max_len, world_size)
    check_rollout(configs[RolloutConfig], grpo, world_size, configs[ClusterConfig].ray)
    check_sleep(configs[StrategyConfig], configs[OptimConfig].optimizer)
    for spec in grpo.reward_names():
        if spec not in ("model", "remote"):
            load_reward_fn(spec)  # importable and callable, or one line now
    if grpo.remote_rm_url:
        check_remote(grpo.remote_rm_url)  # a reward_func file or server URLs, or one line
    if grpo.agent_func_path:
        load_agent(grpo.agent_func_path)  # an environment class, or one line now
    if grpo.tools:
        load_tools(grpo.tools)  # functions with schemas, or one line now
        if not configs[DataConfig].apply_chat_template:
            fail("tools", grpo.tools, "the tools' schemas reach the model through the chat "
                 "template; add --apply_chat_template")
    if grpo.kl_coef > 0 and (model.ref_pretrain or model.pretrain) is None:
        fail("kl_coef", grpo.kl_coef, "the reference is the --pretrain model (or "
             "--ref_pretrain); pass one or set --kl_coef 0")


def rollout_counted(train: TrainConfig, grpo: GRPOConfig, train_batch_size: int) -> TrainConfig:
    """``train`` with ``--save_rollouts``/``--eval_rollouts`` (OpenRLHF's rollout-counted
    ``--ckpt.save_steps``/``--eval.steps``) as the optimizer steps they span: N rollouts are
    N x ``updates_per_rollout`` steps here."""
    span, changes = grpo.updates_per_rollout(train_batch_size), {}
    for steps, rollouts in (("save_steps", "save_rollouts"), ("eval_steps", "eval_rollouts")):
        count = getattr(grpo, rollouts)
        if count is None:
            continue
        if getattr(train, steps) != -1:
            fail(rollouts, count, f"it sets --{steps} (N rollouts = N x {span} steps); give "
                 "one of them")
        changes[steps] = count if count == -1 else count * span
    return dataclasses.replace(train, **changes) if changes else train


def check_grpo(strategy_config: Any, train: Any, grpo: GRPOConfig, max_len: int,
               world_size: int) -> None:
    """Before any process group starts: what GRPO cannot run with, one line each."""
    for name in ("sequence_parallel_size", "tensor_parallel_size"):
        if getattr(strategy_config, name) > 1:
            fail(name, getattr(strategy_config, name), "GRPO generates whole sequences on every "
                 "rank; run it data-parallel (size 1)")
    prompts_per_rank(strategy_config, world_size, grpo.group_size, grpo.rollout_batch_size)
    span = grpo.updates_per_rollout(strategy_config.train_batch_size)
    for name in ("max_steps", "save_steps", "eval_steps"):
        value = getattr(train, name)
        if value > 0 and value % span:
            why = (f"ppo_epochs={grpo.ppo_epochs}" if grpo.rollout_batch_size is None else
                   f"{span} (ppo_epochs={grpo.ppo_epochs} passes over rollout_batch_size x "
                   "group_size completions in steps of train_batch_size)")
            fail(name, value, f"a rollout spans {why} optimizer steps; use a multiple of {span}")
    if grpo.max_new_tokens >= max_len:
        fail("max_new_tokens", grpo.max_new_tokens, f"prompt and completion share max_len="
             f"{max_len}; raise --max_len or lower --max_new_tokens")


def check_rollout(rollout: RolloutConfig, grpo: GRPOConfig, world_size: int,
                  ray: bool = False) -> None:
    """The rollout engine's settings GRPO/PPO cannot run with, before any process group
    (``ray``: a Ray job's driver checks them)."""
    check_vllm_settings(rollout, world_size, ray)
    if rollout.async_rollouts and not rollout.vllm:
        fail("async_rollouts", rollout.async_rollouts, "the hf engine generates with the "
             "training ranks' own module, so nothing would overlap; add --rollout_engine vllm")
    if rollout.async_rollouts and grpo.dynamic_filtering:
        fail("async_rollouts", rollout.async_rollouts, "dynamic sampling decides the next "
             "round from this one's rewards; drop one of them")
    if rollout.partial_rollouts and grpo.episodic:
        fail("partial_rollouts", True, "episodes played ahead take the weights of the step "
             "before, whole, not between two engine steps of a turn; drop --partial_rollouts "
             "(--async_rollouts 1 plays them ahead)")
    for name in ("temperature", "eval_temperature"):
        if rollout.vllm and getattr(grpo, name) > 2:
            fail(name, getattr(grpo, name), "vLLM samples at temperatures in [0, 2]; use one "
                 "there, or --rollout_engine hf")
    if rollout.is_correction is not None and grpo.policy_loss_type != "ppo":
        fail("is_correction", rollout.is_correction, "it weighs each token's loss, as "
             "OpenRLHF's; use it with --policy_loss_type ppo or drop it")
