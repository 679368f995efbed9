"""Step time through the strategy vs a hand-written raw ``deepspeed.initialize`` loop, same run.

deepspeed --num_gpus 2 benchmarks/bench_overhead.py [--zero_stage 2] [--steps 20] [--repeats 3]

Both loops train identical copies of one model on the same batches with the same DeepSpeed
config; steps alternate (raw, strategy, raw, ...) so drift hits both. Target ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import statistics
import time

import deepspeed
import torch
from deepspeed.ops.adam import FusedAdam
from transformers import AutoModelForCausalLM, LlamaConfig

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
from strategy.optim import get_param_groups


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )


def timed_steps(engine, batches, backward, step) -> list[float]:
    times = []
    for x in batches:
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        backward(loss)
        step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero_stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    cfg = StrategyConfig(zero_stage=args.zero_stage, micro_train_batch_size=4, train_batch_size=8)
    s = DeepSpeedStrategy(cfg, OptimConfig(learning_rate=1e-4))
    s.setup_distributed()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(model_config())
    raw_model, ours_model = (
        AutoModelForCausalLM.from_config(model_config()),
        s.from_pretrained(model_config()),
    )
    raw_model.load_state_dict(base.state_dict())
    ours_model.load_state_dict(base.state_dict())

    groups = [
        {k: v for k, v in g.items() if k != "names"} for g in get_param_groups(raw_model, 0.0)
    ]
    raw, *_ = deepspeed.initialize(
        model=raw_model, optimizer=FusedAdam(groups, lr=1e-4, betas=(0.9, 0.95)), config=s.ds_config
    )
    ours = s.prepare((ours_model, s.create_optimizer(ours_model), None))
    g = torch.Generator().manual_seed(s.rank)
    batches = [torch.randint(0, 512, (4, 128), generator=g) for _ in range(args.steps)]
    timed_steps(raw, batches[:3], raw.backward, raw.step)  # warm-up both
    timed_steps(
        ours, batches[:3], lambda loss: s.backward(loss, ours), lambda: s.optimizer_step(ours)
    )
    raw_t, ours_t = [], []
    for r in range(args.repeats):
        for x in batches:  # interleave step by step, alternating which goes first
            pair = [
                (raw_t, raw, raw.backward, raw.step),
                (ours_t, ours, lambda loss: s.backward(loss, ours), lambda: s.optimizer_step(ours)),
            ]
            for out, engine, backward, step in pair if r % 2 == 0 else pair[::-1]:
                out += timed_steps(engine, [x], backward, step)
    raw_med, ours_med = (
        s.all_reduce(statistics.median(raw_t), "max"),
        s.all_reduce(statistics.median(ours_t), "max"),
    )
    s.print(f"zero_stage={args.zero_stage} steps={args.steps}x{args.repeats} world={s.world_size}")
    s.print(f"raw deepspeed loop : {raw_med * 1e3:8.2f} ms/step (median)")
    s.print(f"strategy loop      : {ours_med * 1e3:8.2f} ms/step (median)")
    s.print(f"ratio strategy/raw : {ours_med / raw_med:.3f}  (target <= 1.02)")
    s.close()


if __name__ == "__main__":
    main()
