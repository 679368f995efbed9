"""A trainer of your own on the public Trainer API: focal-loss fine-tuning.

deepspeed --num_gpus 2 examples/custom_trainer.py --config configs/sft_zero2.yaml --focal_gamma 2
deepspeed --num_gpus 2 examples/custom_trainer.py --config configs/sft_zero3.yaml --packing_samples
torchrun --nproc_per_node 2 examples/custom_trainer.py --config configs/sft_zero2.yaml \
    --sequence_parallel_size 2

The focal loss (Lin et al. 2017) weighs each response token's cross-entropy by (1 - p)^gamma,
p the probability of the right token: tokens the model already gets right count less, hard ones
more (gamma 0 is plain cross-entropy). The trainer declares its data (``data = SFT``), counts the
tokens its loss averages over (``loss_counts``), returns ``normalize(sum, "tokens")`` so every
response token of an optimizer step weighs the same however the step is split, and reads the
next-token log-probs through ``token_logps``, which handles padded, packed (position ids, no
mask) and sequence-parallel (``shift_labels``) batches alike. Everything else (accumulation,
clipping, logging, exact evaluation, checkpoints, export) comes from the loop.
"""

import argparse

import torch

from strategy.trainers import Run, Trainer
from strategy.trainers.data import SFT
from strategy.trainers.losses import IGNORE, token_logps


def focal_token_losses(logp: torch.Tensor, gamma: float) -> torch.Tensor:
    """-(1 - p)^gamma log p for each token's log-probability ``logp`` (0 where ``logp`` is 0,
    i.e. unscored positions)."""
    return -((1 - logp.exp()) ** gamma) * logp


class FocalLossTrainer(Trainer):
    """Causal LM on (prompt, response) or chat samples with a focal loss on response tokens."""

    data = SFT

    def __init__(self, *args, focal_gamma: float = 2.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.focal_gamma = focal_gamma

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"tokens": int((batch["labels"][:, 1:] != IGNORE).sum())}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        logp, mask = token_logps(self.model, batch)  # this rank's slice under SP
        focal = focal_token_losses(logp, self.focal_gamma)[mask]
        scored = int(mask.sum())
        metrics = {"ce": (-logp[mask].sum().item(), scored),  # exact means over all tokens
                   "target_prob": (logp[mask].exp().sum().item(), scored)}
        return self.normalize(focal.sum(), "tokens"), metrics


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--focal_gamma", type=float, default=2.0,
                        help="focusing exponent of the focal loss (0: cross-entropy)")
    with Run.from_args(argv, parser) as run:
        trainer = run.trainer(FocalLossTrainer, run.model(), focal_gamma=run.args.focal_gamma)
        return trainer.fit()


if __name__ == "__main__":
    main()
