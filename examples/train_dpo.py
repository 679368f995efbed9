"""DPO on preference pairs against a frozen copy of the starting model (``--loss_type sigmoid |
ipo | hinge | robust``).

deepspeed --num_gpus 2 examples/train_dpo.py --config configs/dpo_zero3.yaml
"""

from strategy.trainers import DPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=DPOTrainer) as run:
        model = run.model()
        trainer = run.trainer(DPOTrainer, model, ref_model=run.reference(model), dpo=run.dpo)
        return trainer.fit()


if __name__ == "__main__":
    main()
