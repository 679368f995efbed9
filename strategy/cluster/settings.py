"""A Ray job's settings, checked by the driver before anything starts (as the actor group's ranks
will check them), and the model groups of their own they place."""

from __future__ import annotations

import os

from strategy.config import StrategyConfig
from strategy.config.cluster import COLOCATE, ClusterConfig
from strategy.errors import ConfigError
from strategy.rollout.remote_models import GROUP_NAMES
from strategy.trainers.config import ModelConfig, PPOConfig


def configs(command: str, argv: list[str]) -> dict:
    """Every setting of ``command`` checked as its ranks will (the actor group's world size);
    ``argv`` in our spellings (``cli.trainers.command_argv``)."""
    from strategy.config.cli import parse_configs  # heavy: trainers, at a job's start only
    from strategy.trainers.run import (  # as above
        CONFIG_CLASSES,
        Run,
        commands,
        foreign_flags,
        hidden_flags,
    )

    trainer = commands()[command]
    parsed, _ = parse_configs(list(CONFIG_CLASSES + tuple(trainer.config_classes)),
                              argv, None, foreign_flags(trainer),
                              hidden_flags(trainer))
    cluster = next(c for c in parsed if isinstance(c, ClusterConfig))
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(cluster.world_size)
    try:
        by_type, _ = Run.check_args(argv, trainer=trainer)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved
    return by_type


def model_groups(by_type: dict) -> tuple[str, ...]:
    """The job's models placed in Ray groups of their own (``ref`` when a KL asks for a
    reference, ``critic`` for PPO, ``reward`` for ``--reward_pretrain``), checked: one line,
    before anything starts, for what such a group cannot take."""
    cluster, model = by_type[ClusterConfig], by_type[ModelConfig]
    trainer = next(c for c in by_type.values() if hasattr(c, "kl_coef"))
    wanted = {"ref": trainer.kl_coef > 0, "critic": isinstance(trainer, PPOConfig),
              "reward": bool(trainer.reward_pretrain)}
    groups = tuple(g for g in ("ref", "critic", "reward") if wanted[g] and cluster.apart(g))
    for group in groups:
        flag = f"{group}_num_gpus_per_node"
        if getattr(cluster, flag) is None:
            flag = f"{group}_num_nodes"
        value, fix = getattr(cluster, flag), COLOCATE[group][1]
        if group == "ref" and not (model.ref_pretrain or model.pretrain):
            raise ConfigError(f"{flag}={value} is invalid without --pretrain or --ref_pretrain: "
                              f"a reference group of its own loads its weights; pass one, or "
                              f"{fix}")
        if by_type[StrategyConfig].model_parallel_size > 1:
            raise ConfigError(f"{flag}={value} is invalid with sequence or tensor parallelism: "
                              f"a {GROUP_NAMES[group]} of its own takes whole micro-batches; pass "
                              f"{fix}")
    return groups
