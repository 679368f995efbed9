"""The algorithms, one file each, all on the public ``Trainer`` API (``trainers.loop``): SFT,
reward model, DPO, the reference-free ORPO and SimPO (``preference``), KTO, online RL (GRPO,
with its ``rewards``, and PPO with a critic on GRPO's rollouts) and on-policy distillation. GRPO's
stages have a module each, mixins of ``GRPOTrainer``: ``experience`` (rollouts to micro-batches),
``policy_update`` (advantages and the loss), ``ahead`` (rollouts generated ahead on vLLM).

May import: ``strategy`` below ``trainers``, and ``trainers.config``, ``losses``, ``data``,
``loop``; nothing underscored of ``Trainer`` (``tests/test_layout.py`` checks).
"""

from strategy.trainers.algorithms.distill import DistillationTrainer
from strategy.trainers.algorithms.dpo import DPOTrainer
from strategy.trainers.algorithms.grpo import GRPOTrainer
from strategy.trainers.algorithms.kto import KTOTrainer
from strategy.trainers.algorithms.ppo import PPOTrainer
from strategy.trainers.algorithms.preference import ORPOTrainer, SimPOTrainer
from strategy.trainers.algorithms.rm import RewardModelTrainer
from strategy.trainers.algorithms.sft import SFTTrainer

__all__ = ["DPOTrainer", "DistillationTrainer", "GRPOTrainer", "KTOTrainer", "ORPOTrainer",
           "PPOTrainer", "RewardModelTrainer", "SFTTrainer", "SimPOTrainer"]
