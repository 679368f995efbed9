"""The whole Trainer loop against a hand-written raw DeepSpeed loop doing the same work, same run.

deepspeed --num_gpus 2 benchmarks/bench_overhead.py [--zero_stage 2] [--rounds 5] [--steps 6]

Both train identical copies of one model on the same pre-collated batches with the same
DeepSpeed config and optimizer kernel, and compute the same token-weighted loss (one count
all-reduce per step, a loss all-reduce for the log). The Trainer adds what it always does: metric
reduction, throughput, JSONL/TensorBoard logging, the progress bar. Rounds of ``--steps`` steps
alternate (raw, Trainer, raw, ...) after both are warmed up; per-step times after the first step
of each round, median and spread over rounds. Target: Trainer <= 1.02x raw.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import deepspeed
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
from strategy.trainers import SFTTrainer, Step, TrainConfig
from strategy.trainers.algorithms.sft import response_tokens

VOCAB, SEQ, MICRO = 512, 128, 4


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=SEQ)


def batches(count: int, seed: int) -> list[dict]:
    """Right-padded rows of different lengths, prompts masked: what SFT collates."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (MICRO, SEQ), generator=generator)
        lengths = torch.randint(SEQ // 4, SEQ + 1, (MICRO,), generator=generator)
        mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        labels[:, : SEQ // 8] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


class RawLoop:
    """What a user writes by hand on ``deepspeed.initialize`` for the same math."""

    def __init__(self, engine, accumulation: int) -> None:
        self.engine, self.accumulation = engine, accumulation
        self.world = torch.distributed.get_world_size()

    def step(self, micro: list[dict]) -> float:
        count = torch.tensor(float(sum(response_tokens(b["labels"]) for b in micro)))
        torch.distributed.all_reduce(count)
        total = 0.0
        for batch in micro:
            loss = self.engine(**batch, num_items_in_batch=1).loss
            scaled = loss * self.accumulation * self.world / count
            self.engine.backward(scaled)
            self.engine.step()
            total += scaled.item()
        logged = torch.tensor(total / self.accumulation)
        torch.distributed.all_reduce(logged)
        return logged.item() / self.world

    def run(self, data: list[dict], steps: int) -> list[float]:
        times = []
        for index in range(steps):
            start = time.perf_counter()
            self.step(data[index * self.accumulation:(index + 1) * self.accumulation])
            times.append(time.perf_counter() - start)
        return times


class TimedTrainer(SFTTrainer):
    """The Trainer, stamping the end of every optimizer step."""

    def on_step_end(self, metrics: dict) -> None:
        self.stamps.append(time.perf_counter())

    def run(self, data: list[dict], steps: int) -> list[float]:
        self.stamps = [time.perf_counter()]
        for index in range(steps):
            self.train_step(Step(data[index * self.strategy.accumulation_steps:
                                      (index + 1) * self.strategy.accumulation_steps]))
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def build(strategy, base_state: dict, log_dir: str, steps: int):
    raw_model = AutoModelForCausalLM.from_config(model_config())
    raw_model.load_state_dict(base_state)
    raw_engine, *_ = deepspeed.initialize(model=raw_model, config=strategy.ds_config,
                                          optimizer=strategy.create_optimizer(raw_model))
    ours_model = strategy.from_pretrained(model_config())
    ours_model.load_state_dict(base_state)
    config = TrainConfig(log_dir=log_dir, logging_steps=1, save_path=f"{log_dir}/model")
    trainer = TimedTrainer(strategy, ours_model, strategy.create_optimizer(ours_model), None,
                           [], None, config)
    return RawLoop(raw_engine, strategy.accumulation_steps), trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    config = StrategyConfig(zero_stage=args.zero_stage, micro_train_batch_size=MICRO,
                            train_batch_size=MICRO * 2 * 2)
    with DeepSpeedStrategy(config, OptimConfig(learning_rate=1e-4)) as strategy:
        strategy.setup_distributed()
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(model_config()).state_dict()
        log_dir = tempfile.mkdtemp(prefix="bench_overhead_")  # only rank 0's logger writes
        raw, trainer = build(strategy, base, log_dir, args.rounds * args.steps)
        accumulation = strategy.accumulation_steps
        data = batches(args.steps * accumulation, seed=strategy.rank)
        raw.run(data, 2)  # warm-up: first-use costs hit neither measurement
        trainer.run(data, 2)
        raw_times, ours_times = [], []
        for _ in range(args.rounds):
            raw_times.append(statistics.median(raw.run(data, args.steps)[1:]))
            ours_times.append(statistics.median(trainer.run(data, args.steps)[1:]))
        report(strategy, args, raw_times, ours_times)


def report(strategy, args, raw_times: list[float], ours_times: list[float]) -> None:
    raw_med, ours_med = statistics.median(raw_times), statistics.median(ours_times)
    ratios = [o / r for o, r in zip(ours_times, raw_times)]
    strategy.print(f"zero_stage={args.zero_stage} world={strategy.world_size} "
                   f"rounds={args.rounds} steps/round={args.steps} (median step time per round)")
    strategy.print(f"raw DeepSpeed loop : {raw_med * 1e3:7.1f} ms/step "
                   f"(spread {min(raw_times) * 1e3:.1f}-{max(raw_times) * 1e3:.1f})")
    strategy.print(f"Trainer loop       : {ours_med * 1e3:7.1f} ms/step "
                   f"(spread {min(ours_times) * 1e3:.1f}-{max(ours_times) * 1e3:.1f})")
    strategy.print(f"ratio Trainer/raw  : median {statistics.median(ratios):.3f} "
                   f"(per round {min(ratios):.3f}-{max(ratios):.3f}; target <= 1.02)")


if __name__ == "__main__":
    main()
