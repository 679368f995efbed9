"""Trainer-side configs, one module per concern, all validating on construction:

- ``common``: what every trainer takes (``ModelConfig``, ``TrainConfig``, ``DataConfig``,
  ``LoraConfig``) and the sampling checks on-policy trainers share;
- ``preference``: DPO, ORPO, SimPO, KTO and the reward model's own knobs;
- ``online``: GRPO's (estimators, losses, episodes), PPO's critic, distillation's.

May import: ``strategy.config`` (the field helpers), ``strategy.errors``, ``strategy.rollout``
(its gather modes).
"""

from strategy.trainers.config.common import (
    LOSS_WEIGHTINGS,
    OVERLONG,
    PAIRED,
    PROMPTED,
    REFERENCED,
    DataConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
    check_sampling,
    positive,
)
from strategy.trainers.config.online import (
    GROUPED,
    KL_ESTIMATORS,
    OUTCOME_ESTIMATORS,
    POLICY_LOSS_AGGS,
    POLICY_LOSS_TYPES,
    DistillConfig,
    GRPOConfig,
    PPOConfig,
)
from strategy.trainers.config.preference import (
    DPO_LOSS_TYPES,
    DPOConfig,
    KTOConfig,
    ORPOConfig,
    RewardConfig,
    SimPOConfig,
)

__all__ = ["DPO_LOSS_TYPES", "GROUPED", "KL_ESTIMATORS", "LOSS_WEIGHTINGS", "OUTCOME_ESTIMATORS",
           "OVERLONG", "PAIRED", "POLICY_LOSS_AGGS", "POLICY_LOSS_TYPES", "PROMPTED",
           "REFERENCED", "DPOConfig", "DataConfig", "DistillConfig", "GRPOConfig", "KTOConfig",
           "LoraConfig", "ModelConfig", "ORPOConfig", "PPOConfig", "RewardConfig", "SimPOConfig",
           "TrainConfig", "check_sampling", "positive"]
