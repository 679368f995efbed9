"""Supervised fine-tuning on a local JSON/JSONL/Parquet file.

deepspeed --num_gpus 2 examples/train_sft.py --config configs/sft_zero2.yaml
torchrun --nproc_per_node 2 examples/train_sft.py --config configs/sft_zero3.yaml --pretrain MODEL_DIR
"""

from strategy.trainers import SFTTrainer
from strategy.trainers.recipe import Run


def main(argv: list[str] | None = None) -> dict:
    run = Run.from_args(argv)
    model = run.model()
    train_loader, eval_loader = run.loaders("sft")
    optimizer, scheduler = run.optimizer_and_scheduler(model, train_loader)
    trainer = SFTTrainer(run.strategy, model, optimizer, scheduler, train_loader, eval_loader, run.train,
                         run.tokenizer)
    metrics = trainer.fit()
    run.strategy.close()
    return metrics


if __name__ == "__main__":
    main()
