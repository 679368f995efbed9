"""ORPO on preference pairs: SFT on the chosen response plus an odds-ratio term, no reference
model.

deepspeed --num_gpus 2 examples/train_orpo.py --config configs/orpo_zero2.yaml
"""

from strategy.trainers import ORPOConfig, ORPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=ORPOTrainer) as run:
        trainer = run.trainer(ORPOTrainer, run.model(), orpo=run.config(ORPOConfig))
        return trainer.fit()


if __name__ == "__main__":
    main()
