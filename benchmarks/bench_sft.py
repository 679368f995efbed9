"""Tokens/s of SFTTrainer vs Hugging Face ``transformers.Trainer``, measured alike, in one run.

deepspeed --num_gpus 2 benchmarks/bench_sft.py [--steps 14] [--skip 4] [--rounds 3] [--zero_stage 2]

Both sides: the same model init, data, micro batch, accumulation and DeepSpeed config; the same
optimizer kernel and schedule (our FusedAdam and cosine schedule, handed to transformers through
``optimizers=``); engine set-up outside the timing window on both (per-step times are measured
from the end of one optimizer step to the end of the next); the first ``--skip`` steps of every
run dropped; rounds alternate (ours, theirs, ours, ...) after a warm-up run of each; tokens/s per
round from the same token counts; median and spread over rounds. Target: ours >= 1.0x theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
from strategy.demos.toy_task import make_tokenizer
from strategy.trainers import SFTTrainer, TrainConfig
from strategy.trainers import data as sft_data
from strategy.trainers.config import DataConfig
from strategy.trainers.recipe import hf_config

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 256}
MICRO = 8


def write_data(root: str, count: int) -> str:
    rng = random.Random(0)
    path = os.path.join(root, "train.jsonl")
    with open(path, "w") as fh:
        for _ in range(count):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(20, 60)))
            fh.write(json.dumps({"input": word + "=", "output": word[::-1]}) + "\n")
    return path


class StepClock:
    """End-of-step timestamps and the tokens each step trained on (counted in the collator)."""

    def __init__(self, collate) -> None:
        self.collate, self.stamps, self.tokens, self.pending = collate, [], [], 0

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        self.pending += int(batch["attention_mask"].sum())
        return batch

    def step_done(self) -> None:
        self.stamps.append(time.perf_counter())
        self.tokens.append(self.pending)
        self.pending = 0

    def tokens_per_second(self, skip: int) -> float:
        """Over the steps after the first ``skip``: tokens of those steps / their time."""
        seconds = self.stamps[-1] - self.stamps[skip - 1]
        return sum(self.tokens[skip:]) / seconds


class ClockedSFT(SFTTrainer):
    def _after_step(self, epoch, sums, bar) -> None:
        super()._after_step(epoch, sums, bar)
        self.clock.step_done()


class ClockCallback(TrainerCallback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.step_done()


def optimizer_and_schedule(strategy, model, steps: int):
    optimizer = strategy.create_optimizer(model)
    return optimizer, strategy.create_scheduler(optimizer, "cosine", num_training_steps=steps,
                                                num_warmup_steps=0)


def run_ours(strategy, model_config, tok, rows, steps: int, skip: int) -> float:
    torch.manual_seed(1)
    model = strategy.from_pretrained(model_config)
    clock = StepClock(sft_data.collate_sft(tok.pad_token_id))
    loader = strategy.setup_dataloader(rows, MICRO, shuffle=True, collate_fn=clock)
    config = TrainConfig(max_steps=steps, logging_steps=1, log_dir=None, save_path="/dev/null")
    trainer = ClockedSFT(strategy, model, *optimizer_and_schedule(strategy, model, steps), loader,
                         None, config, tok)
    trainer.clock, trainer.save_model = clock, lambda path: None  # time training only
    trainer.fit()
    return strategy.all_reduce(clock.tokens_per_second(skip), "sum")


def run_theirs(strategy, model_config, tok, rows, steps: int, skip: int, out: str) -> float:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(model_config)
    clock = StepClock(sft_data.collate_sft(tok.pad_token_id))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, max_steps=steps,
        gradient_accumulation_steps=strategy.accumulation_steps, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], deepspeed=dict(strategy.ds_config),
        dataloader_num_workers=0, use_cpu=get_accelerator().device_name() == "cpu", seed=1,
        disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=clock,
                      optimizers=optimizer_and_schedule(strategy, model, steps),
                      callbacks=[ClockCallback(clock)])
    clock.stamps.clear()
    trainer.train()
    return strategy.all_reduce(clock.tokens_per_second(skip), "sum")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    config = StrategyConfig(zero_stage=args.zero_stage, micro_train_batch_size=MICRO,
                            train_batch_size=MICRO * 2 * 2)
    with DeepSpeedStrategy(config, OptimConfig(learning_rate=1e-4)) as strategy:
        strategy.setup_distributed()
        root = strategy.on_rank_0(tempfile.mkdtemp)
        strategy.on_rank_0(make_tokenizer, os.path.join(root, "tok"))
        strategy.on_rank_0(write_data, root, 4096)
        tok = AutoTokenizer.from_pretrained(os.path.join(root, "tok"))
        rows = sft_data.load_sft(os.path.join(root, "train.jsonl"), tok, DataConfig(max_len=128))
        model_config = hf_config_from_dict(MODEL, tok, root, strategy)
        run_ours(strategy, model_config, tok, rows, args.skip + 2, args.skip)  # warm-ups
        run_theirs(strategy, model_config, tok, rows, args.skip + 2, args.skip, f"{root}/hf")
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(run_ours(strategy, model_config, tok, rows, args.steps, args.skip))
            theirs.append(run_theirs(strategy, model_config, tok, rows, args.steps, args.skip,
                                     f"{root}/hf"))
        report(strategy, args, ours, theirs)


def report(strategy, args, ours: list[float], theirs: list[float]) -> None:
    ratios = [a / b for a, b in zip(ours, theirs)]
    strategy.print(f"zero_stage={args.zero_stage} world={strategy.world_size} micro={MICRO} "
                   f"accum={strategy.accumulation_steps} steps={args.steps} (first {args.skip} "
                   f"skipped) rounds={args.rounds}")
    for name, values in (("SFTTrainer", ours), ("transformers.Trainer", theirs)):
        strategy.print(f"{name:<21}: median {statistics.median(values):8.0f} tokens/s "
                       f"(spread {min(values):.0f}-{max(values):.0f})")
    strategy.print(f"ratio ours/theirs    : median {statistics.median(ratios):.3f} "
                   f"(per round {min(ratios):.3f}-{max(ratios):.3f}; target >= 1.0)")


def write_json(path: str, values: dict) -> None:
    with open(path, "w") as fh:
        json.dump(values, fh)


def hf_config_from_dict(values: dict, tok, root: str, strategy):
    path = os.path.join(root, "model.json")
    strategy.on_rank_0(write_json, path, values)
    return hf_config(path, tok)


if __name__ == "__main__":
    main()
