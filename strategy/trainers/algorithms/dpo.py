"""Direct preference optimization against a frozen reference prepared by the same strategy.

The DPO term weighs every pair of a step the same; the optional NLL term on the chosen responses
weighs every chosen token the same. Under sequence parallelism each rank holds a slice of every
sequence: its log-probability sums are added over the group with a gradient-carrying all-reduce,
whose backward sums every rank's gradient, so the pair term (the same on every rank) is divided by
the group size; the NLL term is a sum over this rank's own tokens and needs no such care.
"""

from __future__ import annotations

import torch

from strategy.trainers.algorithms.sft import refuse_router_loss
from strategy.trainers.config import DPOConfig
from strategy.trainers.data import PAIRS
from strategy.trainers.data.packing import pair_count, per_sample_sums
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import IGNORE, dpo_loss, dpo_losses, token_logps

__all__ = ["DPOTrainer", "dpo_loss", "sequence_logps"]


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed log-probability of each sample's response tokens (of this rank's slice): chosen
    samples first, then rejected, for plain or packed pair batches."""
    logp, _ = token_logps(model, batch)
    if "sample_index" not in batch:
        return logp.sum(-1)
    index = batch["sample_index"][:, 1:]  # the token each next-token target is
    return per_sample_sums(logp, index, 2 * pair_count(batch))


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

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:  # DPO adds no router loss
        refuse_router_loss(configs, cls.__name__)

    def __init__(self, strategy, model, ref_model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None,
                 dpo: DPOConfig | None = None) -> None:
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader, eval_dataloader,
                         config, tokenizer)
        self.dpo = dpo or DPOConfig()
        self.ref_model = strategy.prepare(ref_model)

    def loss_counts(self, batch: dict) -> dict[str, int]:
        pairs = pair_count(batch)
        if "sample_index" in batch:  # packed: chosen samples are numbered below `pairs`
            chosen = (batch["sample_index"][:, 1:] < pairs) & (batch["sample_index"][:, 1:] >= 0)
            tokens = chosen & (batch["labels"][:, 1:] != IGNORE)
        else:
            tokens = batch["labels"][:pairs, 1:] != IGNORE
        return {"pairs": pairs, "chosen_tokens": int(tokens.sum())}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        local = sequence_logps(self.model, batch).float()
        logps = self.strategy.sequence_sum(local, keep_gradient=True)
        with torch.no_grad():
            ref = self.strategy.sequence_sum(sequence_logps(self.ref_model, batch).float())
        half = logps.shape[0] // 2
        losses, metrics = dpo_losses(logps[:half], logps[half:], ref[:half], ref[half:],
                                     self.dpo.beta, self.dpo.label_smoothing)
        loss = self.normalize(losses.sum(), "pairs") / self.strategy.sequence_parallel_size
        if self.dpo.nll_loss_coef > 0:
            nll = self.normalize(-local[:half].sum(), "chosen_tokens")
            loss = loss + self.dpo.nll_loss_coef * nll
        return loss, metrics
