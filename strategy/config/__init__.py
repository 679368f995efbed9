"""Configuration: typed dataclass configs that validate on construction, their YAML/argparse
binding, and the pure builder from a ``StrategyConfig`` to DeepSpeed's config dict.

May import: ``strategy.errors``, ``strategy.internals`` (DeepSpeed's key list and ZeRO schema).
Nothing here starts processes or touches the disk beyond reading a YAML file. Other subsystems keep
their own config dataclasses beside their code (``optim.config``, ``checkpoint.config``,
``trainers.config``) built from ``config.fields``.
"""

from strategy.config.cli import (
    PRINT_FLAG,
    add_config_args,
    build_configs,
    parse_configs,
    print_settings_and_exit,
    read_yaml,
)
from strategy.config.ds_config import build_ds_config, build_eval_ds_config, deep_merge
from strategy.config.fields import doc
from strategy.config.strategy_config import StrategyConfig
from strategy.errors import ConfigError

__all__ = ["PRINT_FLAG", "ConfigError", "StrategyConfig", "add_config_args", "build_configs",
           "build_ds_config", "build_eval_ds_config", "deep_merge", "doc", "parse_configs",
           "print_settings_and_exit", "read_yaml"]
