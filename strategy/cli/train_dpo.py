"""DPO on preference pairs against a frozen copy of the starting model (``--loss_type sigmoid |
ipo | hinge | robust``).

strategy dpo --nproc 2 --config dpo_zero3 --pretrain SFT_DIR --dataset pairs.jsonl
deepspeed --num_gpus 2 --module strategy.cli.train_dpo --config dpo_zero3 --pretrain SFT_DIR
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.trainers import DPOConfig, DPOTrainer
from strategy.trainers.algorithms.preference import reference_model
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "dpo"), trainer=DPOTrainer) as run:
        model = run.model()
        trainer = run.trainer(DPOTrainer, model, ref_model=reference_model(run, model),
                              dpo=run.config(DPOConfig))
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
