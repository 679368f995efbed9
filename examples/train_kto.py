"""KTO on completions labelled desirable or not (``prompt``/``completion``/``label`` rows; a
preference row gives one of each), against a frozen copy of the starting model.

deepspeed --num_gpus 2 examples/train_kto.py --config configs/kto_zero3.yaml
"""

from strategy.trainers import KTOConfig, KTOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=KTOTrainer) as run:
        model = run.model()
        trainer = run.trainer(KTOTrainer, model, ref_model=run.reference(model),
                              kto=run.config(KTOConfig))
        return trainer.fit()


if __name__ == "__main__":
    main()
