"""Reward model on preference pairs (prompt, chosen, rejected) from a local file.

deepspeed --num_gpus 2 examples/train_rm.py --config configs/rm_zero2.yaml
"""

from transformers import AutoModelForSequenceClassification

from strategy.trainers import RewardModelTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=RewardModelTrainer) as run:
        model = run.model(AutoModelForSequenceClassification, lora_task="SEQ_CLS",
                          modules_to_save=["score"], num_labels=1)
        return run.trainer(RewardModelTrainer, model).fit()


if __name__ == "__main__":
    main()
