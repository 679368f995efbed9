"""ORPO on preference pairs: SFT on the chosen response plus an odds-ratio term, no reference
model.

strategy orpo --nproc 2 --config orpo_zero2 --pretrain SFT_DIR --dataset pairs.jsonl
deepspeed --num_gpus 2 --module strategy.cli.train_orpo --config orpo_zero2 --pretrain SFT_DIR
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.trainers import ORPOConfig, ORPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "orpo"), trainer=ORPOTrainer) as run:
        trainer = run.trainer(ORPOTrainer, run.model(), orpo=run.config(ORPOConfig))
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
