"""Trainers that take a strategy as a dependency, laid out by concern:

- ``loop/``: the ``Trainer`` every trainer subclasses, with its public hooks (read its
  docstring first), exact metric sums, step arithmetic, throughput figures;
- ``algorithms/``: SFT, reward model, DPO, ORPO/SimPO (``preference``), KTO, GRPO and PPO
  (online RL) with GRPO's rewards and dynamic sampling (``groups``), on-policy distillation;
- ``data/``: files to token ids, chats, packing, collation, and the ``DataSpec`` a trainer
  declares;
- ``losses/``: pure loss formulas and the language-model forwards behind them;
- ``config.py``: the trainer-side configs; ``run.py``: ``Run``, which builds a strategy, model,
  loaders, optimizer and schedule from flags for every example.

May import: anything in ``strategy``; nothing in ``strategy`` imports from here. Inside, imports
flow losses -> data -> loop -> algorithms -> run. The loop never branches on rank: the strategy
reduces metrics and writes files on rank 0 only.
"""

from strategy.trainers.algorithms import (
    DistillationTrainer,
    DPOTrainer,
    GRPOTrainer,
    KTOTrainer,
    ORPOTrainer,
    PPOTrainer,
    RewardModelTrainer,
    SFTTrainer,
    SimPOTrainer,
)
from strategy.trainers.config import (
    DataConfig,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    LoraConfig,
    ModelConfig,
    ORPOConfig,
    PPOConfig,
    RewardConfig,
    SimPOConfig,
    TrainConfig,
)
from strategy.trainers.data import DataSpec
from strategy.trainers.loop import Step, Trainer
from strategy.trainers.run import Run

__all__ = ["DPOConfig", "DPOTrainer", "DataConfig", "DataSpec", "DistillConfig",
           "DistillationTrainer", "GRPOConfig", "GRPOTrainer",
           "KTOConfig", "KTOTrainer", "LoraConfig", "ModelConfig", "ORPOConfig", "ORPOTrainer",
           "PPOConfig", "PPOTrainer",
           "RewardConfig", "RewardModelTrainer", "Run", "SFTTrainer", "SimPOConfig",
           "SimPOTrainer", "Step", "TrainConfig", "Trainer"]
