"""strategy: a small training-strategy framework for Hugging Face models on DeepSpeed ZeRO."""

from strategy.config import ConfigError, OptimConfig, StrategyConfig, parse_configs
from strategy.dist import print0
from strategy.ds_config import build_ds_config, build_eval_ds_config
from strategy.hybrid_adam import HybridAdam
from strategy.scheduler import CosineAnnealingWarmupLR
from strategy.strategy import DeepSpeedStrategy

__all__ = ["ConfigError", "CosineAnnealingWarmupLR", "DeepSpeedStrategy", "HybridAdam", "OptimConfig",
           "StrategyConfig", "build_ds_config", "build_eval_ds_config", "parse_configs", "print0"]
