"""A reward model (one-label sequence classifier) on preference pairs, pairwise loss.

strategy rm --nproc 2 --config rm_zero2 --pretrain MODEL_DIR --dataset pairs.jsonl
deepspeed --num_gpus 2 --module strategy.cli.train_rm --config rm_zero2 --pretrain MODEL_DIR
"""

from transformers import AutoModelForSequenceClassification

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.trainers import RewardModelTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "rm"), trainer=RewardModelTrainer) as run:
        model = run.model(AutoModelForSequenceClassification, lora_task="SEQ_CLS",
                          modules_to_save=["score"], num_labels=1)
        return run.trainer(RewardModelTrainer, model).fit()


if __name__ == "__main__":
    run_script(main)
