"""Direct preference optimization against a frozen reference prepared by the same strategy.

``--loss_type`` picks the pair loss: sigmoid (DPO; conservative with ``--label_smoothing``), ipo,
hinge or robust; every one is a function of the summed log-prob margin, as OpenRLHF and TRL's
default compute it (TRL alone length-normalises for ipo). The pair term weighs every pair of a
step the same; the optional NLL term on the chosen responses weighs every chosen token the same.
Sequence parallelism: see ``preference``.
"""

from __future__ import annotations

import torch

from strategy.trainers.algorithms.preference import (
    check_reference_source,
    pair_loss_counts,
    sequence_logps,
)
from strategy.trainers.config import DPOConfig
from strategy.trainers.data import PAIRS
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import dpo_loss, dpo_losses

__all__ = ["DPOTrainer", "dpo_loss", "sequence_logps"]


class DPOTrainer(Trainer):
    """Policy trains; ``ref_model`` becomes an eval engine (ZeRO-3 sharded if training is
    ZeRO-3).

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy to train.
        ref_model: the frozen reference.
        optimizer: the policy's optimizer.
        scheduler: its learning-rate schedule.
        train_dataloader: the pair loader (``PAIRS``).
        eval_dataloader: held-out pairs, or None.
        config: the ``TrainConfig``.
        tokenizer: saved with exports and checkpoints.
        dpo: the ``DPOConfig`` (default: ``DPOConfig()``).
    """

    data = PAIRS
    command = "dpo"
    config_classes = (DPOConfig,)

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        check_reference_source(configs)

    def __init__(self, strategy, model, ref_model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None,
                 dpo: DPOConfig | None = None) -> None:
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader, eval_dataloader,
                         config, tokenizer)
        self.dpo = dpo or DPOConfig()
        self.ref_model = strategy.prepare(ref_model)

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return pair_loss_counts(batch)

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        local = sequence_logps(self.model, batch).float()
        logps = self.strategy.sequence_sum(local, keep_gradient=True)
        with torch.no_grad():
            ref = self.strategy.sequence_sum(sequence_logps(self.ref_model, batch).float())
        half = logps.shape[0] // 2
        cfg = self.dpo
        losses, metrics = dpo_losses(logps[:half], logps[half:], ref[:half], ref[half:],
                                     cfg.beta, cfg.label_smoothing, cfg.loss_type)
        loss = self.normalize(losses.sum(), "pairs") / self.strategy.sequence_parallel_size
        if cfg.nll_loss_coef > 0:
            nll = self.normalize(-local[:half].sum(), "chosen_tokens")
            loss = loss + cfg.nll_loss_coef * nll
        return loss, metrics
