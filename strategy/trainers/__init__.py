"""Trainers that take a strategy as a dependency: the shared loop with its hooks (``loop``), one
file per algorithm (SFT, reward model, DPO), their losses as pure functions (``losses``), data
files to token ids (``data``), step arithmetic (``steps``), their configs, online RL (``grpo``
with its ``rewards``), and ``recipe.Run``, which builds everything an example needs from flags.

May import: anything in ``strategy``; nothing in ``strategy`` imports from here. The loop never
branches on rank: the strategy reduces metrics and writes files on rank 0 only.
"""

from strategy.trainers.config import (
    DataConfig,
    DPOConfig,
    GRPOConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from strategy.trainers.dpo import DPOTrainer
from strategy.trainers.grpo import GRPOTrainer
from strategy.trainers.loop import Trainer
from strategy.trainers.rm import RewardModelTrainer
from strategy.trainers.sft import SFTTrainer

__all__ = ["DPOConfig", "DPOTrainer", "DataConfig", "GRPOConfig", "GRPOTrainer", "LoraConfig",
           "ModelConfig", "RewardModelTrainer", "SFTTrainer", "TrainConfig", "Trainer"]
