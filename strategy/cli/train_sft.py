"""Supervised fine-tuning on prompt/response or chat data (a JSON/JSONL/Parquet file, a dataset
folder or a Hub id).

strategy sft --nproc 2 --config sft_zero2 --pretrain MODEL_DIR --dataset data.jsonl
deepspeed --num_gpus 2 --module strategy.cli.train_sft --config sft_zero2 --pretrain MODEL_DIR
torchrun --nproc_per_node 2 -m strategy.cli.train_sft --config sft_zero3 --pretrain MODEL_DIR
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.trainers import SFTTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "sft"), trainer=SFTTrainer) as run:
        return run.trainer(SFTTrainer, run.model()).fit()


if __name__ == "__main__":
    run_script(main)
