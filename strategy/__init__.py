"""strategy: a small training-strategy framework for Hugging Face models on DeepSpeed ZeRO.

Layers, each importing only from the ones above it:
    errors, dtypes, internals            what everything shares (no other strategy import)
    dist, atomic_fs                      ranks and collectives; files that appear whole
    config/, quant                       typed configs, CLI/YAML binding, DeepSpeed config; 4-bit
    optim/, checkpoint/, sampler, metrics, lora, ops, attention     one concern each
    ema                                  moving average of the weights, partitioned like them
    model, parallel/, export/            HF models; sequence/tensor parallelism; HF export
    decode                               the rollouts' lean sampling loop (uses model)
    rollout/                             where on-policy completions come from: hf or vLLM
                                         engines (uses export)
    engines                              training-engine checks; OpenRLHF's unpacking of one
    deepspeed_strategy                   the facade: DeepSpeedStrategy
    trainers/, demos/                    loops and recipes built on the facade
    cli/                                 the installed commands: strategy <trainer>, train_*
"""

from strategy.attention import attention_for  # registers sdpa_varlen with transformers
from strategy.checkpoint import CheckpointConfig
from strategy.config import StrategyConfig, build_ds_config, build_eval_ds_config, parse_configs
from strategy.deepspeed_strategy import DeepSpeedStrategy
from strategy.dist import print0
from strategy.errors import ConfigError, StrategyError
from strategy.optim import CosineAnnealingWarmupLR, HybridAdam, OptimConfig

__all__ = ["CheckpointConfig", "ConfigError", "CosineAnnealingWarmupLR", "DeepSpeedStrategy",
           "HybridAdam", "OptimConfig", "StrategyConfig", "StrategyError", "attention_for",
           "build_ds_config", "build_eval_ds_config", "parse_configs", "print0"]
