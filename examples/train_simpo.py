"""SimPO on preference pairs: length-normalised rewards with a target margin, no reference model.

deepspeed --num_gpus 2 examples/train_simpo.py --config configs/simpo_zero3.yaml
"""

from strategy.trainers import SimPOConfig, SimPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=SimPOTrainer) as run:
        trainer = run.trainer(SimPOTrainer, run.model(), simpo=run.config(SimPOConfig))
        return trainer.fit()


if __name__ == "__main__":
    main()
