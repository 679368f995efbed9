"""A trainer of your own: subclass SFTTrainer and override one hook (here, the loss).

deepspeed --num_gpus 2 examples/custom_trainer.py --config configs/sft_zero2.yaml --z_loss 1e-4

This one adds a z-loss (a penalty on log Z = logsumexp of the logits, as in PaLM) to the response
loss; everything else (accumulation, clipping, logging, eval, checkpoints, export) is inherited.
"""

import argparse

import torch

from strategy.trainers import SFTTrainer
from strategy.trainers.losses import IGNORE, response_loss
from strategy.trainers.recipe import Run


class ZLossSFTTrainer(SFTTrainer):
    z_loss: float = 1e-4

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        logits = self.model(input_ids=batch["input_ids"],
                            attention_mask=batch["attention_mask"]).logits
        loss, tokens = response_loss(logits, batch["labels"])
        mask = batch["labels"][:, 1:] != IGNORE
        log_z = torch.logsumexp(logits[:, :-1].float(), dim=-1)[mask]
        z_penalty = (log_z**2).mean()
        metrics = {"response_loss": loss.item(), "z": z_penalty.item(), "response_tokens": tokens}
        return loss + self.z_loss * z_penalty, metrics


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--z_loss", type=float, default=1e-4, help="weight of the z-loss")
    with Run.from_args(argv, parser) as run:
        trainer = run.trainer(ZLossSFTTrainer, run.model())
        trainer.z_loss = run.args.z_loss
        return trainer.fit()


if __name__ == "__main__":
    main()
