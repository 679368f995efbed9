"""Optimizers: parameter groups (no decay on biases and norm weights), the optimizer factory
(DeepSpeed's FusedAdam / DeepSpeedCPUAdam, our HybridAdam with its NVMe state files), and
learning-rate schedules, with their ``OptimConfig``.

May import: ``strategy.errors``, ``strategy.internals`` (DeepSpeed's Adam kernels),
``strategy.config.fields``. Knows nothing of engines, checkpoints or trainers.
"""

from strategy.optim.config import OPTIMIZERS, OptimConfig
from strategy.optim.factory import build_optimizer
from strategy.optim.groups import get_param_groups, split_decay_params
from strategy.optim.hybrid_adam import HybridAdam
from strategy.optim.scheduler import CosineAnnealingWarmupLR, create_scheduler

__all__ = ["OPTIMIZERS", "CosineAnnealingWarmupLR", "HybridAdam", "OptimConfig", "build_optimizer",
           "create_scheduler", "get_param_groups", "split_decay_params"]
