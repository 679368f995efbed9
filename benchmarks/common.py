"""What the benchmarks share: per-step clocks for our Trainer and transformers' Trainer, and
runs of each over the same rows with the same optimizer kernel and schedule.

Both sides are timed alike: a clock stamps the end of every optimizer step (ours in the loop,
theirs in a callback), engine set-up falls before the first stamp, and ``tokens_per_second``
skips the first steps of a run. Tokens are counted in the collator (non-padding tokens only).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from deepspeed.accelerator import get_accelerator
from transformers import Trainer, TrainerCallback, TrainingArguments

from strategy.trainers import SFTTrainer, TrainConfig


def useful_tokens(batch: dict) -> int:
    """Non-padding tokens of a collated batch (packed rows say so; else the attention mask)."""
    if "token_count" in batch:
        return int(batch["token_count"])
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())  # flattened rows have no padding


class StepClock:
    """End-of-step timestamps and the useful tokens each step trained on."""

    def __init__(self, collate) -> None:
        self.collate, self.stamps, self.tokens, self.pending = collate, [], [], 0

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        self.pending += useful_tokens(batch)
        return batch

    def step_done(self) -> None:
        self.stamps.append(time.perf_counter())
        self.tokens.append(self.pending)
        self.pending = 0

    def tokens_per_second(self, skip: int) -> float:
        """Over the steps after the first ``skip``: their tokens / their time."""
        return sum(self.tokens[skip:]) / (self.stamps[-1] - self.stamps[skip - 1])


class ClockedSFT(SFTTrainer):
    def on_step_end(self, metrics: dict) -> None:
        self.clock.step_done()


class ClockCallback(TrainerCallback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.step_done()


def optimizer_and_schedule(strategy, model, steps: int):
    """Our FusedAdam and a cosine schedule: what both sides step with."""
    optimizer = strategy.create_optimizer(model)
    return optimizer, strategy.create_scheduler(optimizer, "cosine", num_training_steps=steps,
                                                num_warmup_steps=0)


def run_ours(strategy, model_config, rows, collate, micro: int, steps: int, skip: int,
             attention: str = "sdpa") -> float:
    """Our SFTTrainer for ``steps`` steps with ``attention``; tokens/s summed over ranks."""
    torch.manual_seed(1)
    model = strategy.from_pretrained(model_config, attn_implementation=attention)
    clock = StepClock(collate)
    loader = strategy.setup_dataloader(rows, micro, shuffle=True, collate_fn=clock)
    config = TrainConfig(max_steps=steps, max_epochs=100, logging_steps=1, log_dir=None,
                         save_path="/dev/null")
    trainer = ClockedSFT(strategy, model, *optimizer_and_schedule(strategy, model, steps), loader,
                         None, config)
    trainer.clock, trainer.save_model = clock, lambda *a, **k: None  # time training only
    trainer.fit()
    return strategy.all_reduce(clock.tokens_per_second(skip), "sum")


def run_theirs(strategy, model_config, rows, collate, micro: int, steps: int, skip: int,
               out: str, attention: str = "sdpa") -> float:
    """transformers' Trainer with the same DeepSpeed config, optimizer and schedule."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config),  # from_config sets
                                             attn_implementation=attention)  # it on the config
    clock = StepClock(collate)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=micro, max_steps=steps,
        gradient_accumulation_steps=strategy.accumulation_steps, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], deepspeed=dict(strategy.ds_config),
        dataloader_num_workers=0, use_cpu=get_accelerator().device_name() == "cpu", seed=1,
        disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=clock,
                      optimizers=optimizer_and_schedule(strategy, model, steps),
                      callbacks=[ClockCallback(clock)])
    trainer.train()
    return strategy.all_reduce(clock.tokens_per_second(skip), "sum")


def spread(values: list[float]) -> str:
    """Median and range of per-round figures."""
    return (f"median {statistics.median(values):8.0f} "
            f"(spread {min(values):.0f}-{max(values):.0f})")
