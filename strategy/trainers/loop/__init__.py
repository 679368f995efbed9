"""The loop every trainer shares (``trainer``: ``Trainer`` and its hooks, ``Step``), exact
per-step and held-out metric sums (``metrics``), step arithmetic (``steps``) and throughput
figures (``throughput``).

May import: ``strategy`` below ``trainers``, ``trainers.config`` and ``trainers.data``.
"""

from strategy.trainers.loop.metrics import Largest
from strategy.trainers.loop.steps import StepPlan, plan_steps
from strategy.trainers.loop.trainer import MAIN, Step, Trainer

__all__ = ["MAIN", "Largest", "Step", "StepPlan", "Trainer", "plan_steps"]
