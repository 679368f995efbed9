"""A trainer of your own: subclass SFTTrainer and override one hook (here, the loss).

deepspeed --num_gpus 2 examples/custom_trainer.py --config configs/sft_zero2.yaml --z_loss 1e-4

This one adds a z-loss (a penalty on log Z = logsumexp of the logits, as in PaLM) to the response
loss; everything else (accumulation, clipping, logging, eval, checkpoints, export) is inherited.
"""

import argparse

import torch

from strategy.trainers import SFTTrainer
from strategy.trainers.recipe import Run
from strategy.trainers.sft import response_loss


class ZLossSFTTrainer(SFTTrainer):
    z_loss: float = 1e-4

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss, n = response_loss(logits, batch["labels"])
        mask = batch["labels"][:, 1:] != -100
        log_z = torch.logsumexp(logits[:, :-1].float(), dim=-1)[mask]
        z = (log_z**2).mean()
        return loss + self.z_loss * z, {"response_loss": loss.item(), "z": z.item(), "response_tokens": n}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--z_loss", type=float, default=1e-4, help="weight of the z-loss")
    run = Run.from_args(argv, parser)
    trainer = run.trainer(ZLossSFTTrainer, run.model())
    trainer.z_loss = run.args.z_loss
    metrics = trainer.fit()
    run.strategy.close()
    return metrics


if __name__ == "__main__":
    main()
