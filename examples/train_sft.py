"""Supervised fine-tuning on a local JSON/JSONL/Parquet file.

deepspeed --num_gpus 2 examples/train_sft.py --config configs/sft_zero2.yaml
torchrun --nproc_per_node 2 examples/train_sft.py --config configs/sft_zero3.yaml \
    --pretrain MODEL_DIR
"""

from strategy.trainers import SFTTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=SFTTrainer) as run:
        return run.trainer(SFTTrainer, run.model()).fit()


if __name__ == "__main__":
    main()
