"""Trainers that take a strategy: a shared loop with hooks, and SFT, reward-model and DPO trainers."""

from strategy.trainers.base import Trainer
from strategy.trainers.config import DataConfig, LoraConfig, TrainConfig
from strategy.trainers.dpo import DPOTrainer
from strategy.trainers.rm import RewardModelTrainer
from strategy.trainers.sft import SFTTrainer

__all__ = ["DPOTrainer", "DataConfig", "LoraConfig", "RewardModelTrainer", "SFTTrainer", "TrainConfig", "Trainer"]
