"""SimPO on preference pairs: length-normalised rewards with a target margin, no reference model.

strategy simpo --nproc 2 --config simpo_zero3 --pretrain SFT_DIR --dataset pairs.jsonl
deepspeed --num_gpus 2 --module strategy.cli.train_simpo --config simpo_zero3 --pretrain SFT_DIR
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.trainers import SimPOConfig, SimPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "simpo"), trainer=SimPOTrainer) as run:
        trainer = run.trainer(SimPOTrainer, run.model(), simpo=run.config(SimPOConfig))
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
