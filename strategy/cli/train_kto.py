"""KTO on completions labelled desirable or not (``prompt``/``completion``/``label`` rows; a
preference row gives one of each), against a frozen copy of the starting model.

strategy kto --nproc 2 --config kto_zero3 --pretrain SFT_DIR --dataset labelled.jsonl
deepspeed --num_gpus 2 --module strategy.cli.train_kto --config kto_zero3 --pretrain SFT_DIR
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.trainers import KTOConfig, KTOTrainer
from strategy.trainers.algorithms.preference import reference_model
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "kto"), trainer=KTOTrainer) as run:
        model = run.model()
        trainer = run.trainer(KTOTrainer, model, ref_model=reference_model(run, model),
                              kto=run.config(KTOConfig))
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
