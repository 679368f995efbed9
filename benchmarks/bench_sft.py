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

from common import run_ours, run_theirs, spread
from transformers import AutoTokenizer

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
from strategy.demos.toy_task import make_tokenizer
from strategy.trainers import data as sft_data
from strategy.trainers.config import DataConfig
from strategy.trainers.run import hf_config

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 256}
MICRO = 8


def write_data(root: str, count: int) -> None:
    rng = random.Random(0)
    with open(os.path.join(root, "train.jsonl"), "w") as fh:
        for _ in range(count):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(20, 60)))
            fh.write(json.dumps({"input": word + "=", "output": word[::-1]}) + "\n")
    with open(os.path.join(root, "model.json"), "w") as fh:
        json.dump(MODEL, fh)


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
        model_config = hf_config(os.path.join(root, "model.json"), tok)
        collate = sft_data.collate_sft(tok.pad_token_id)
        common = (strategy, model_config, rows, collate, MICRO)
        run_ours(*common, args.skip + 2, args.skip)  # warm-ups: first-use costs hit neither
        run_theirs(*common, args.skip + 2, args.skip, f"{root}/hf")
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(run_ours(*common, args.steps, args.skip))
            theirs.append(run_theirs(*common, args.steps, args.skip, f"{root}/hf"))
        ratios = [a / b for a, b in zip(ours, theirs)]
        strategy.print(f"zero_stage={args.zero_stage} world={strategy.world_size} micro={MICRO} "
                       f"accum={strategy.accumulation_steps} steps={args.steps} (first "
                       f"{args.skip} skipped) rounds={args.rounds}, tokens/s over all ranks")
        strategy.print(f"SFTTrainer           : {spread(ours)}")
        strategy.print(f"transformers.Trainer : {spread(theirs)}")
        strategy.print(f"ratio ours/theirs    : median {statistics.median(ratios):.3f} "
                       f"(per round {min(ratios):.3f}-{max(ratios):.3f}; target >= 1.0)")


if __name__ == "__main__":
    main()
