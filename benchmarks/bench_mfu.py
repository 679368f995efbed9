"""Model FLOPs utilisation of a ~1.1B LLaMA trained through the strategy at ZeRO-2 bf16.

python benchmarks/bench_mfu.py [--micro 8] [--seq 2048] [--steps 10] [--tiny]

One rank (a plain ``python`` run is world size 1; torchrun works too). The model is built from a
config (hidden 2048, 16 layers, 32 heads, intermediate 8192, vocabulary 32000: 1.07B parameters
in its layers, 1.20B with the untied embeddings; nothing is downloaded) on the accelerator, with
sdpa attention, no gradient checkpointing, and trained on random tokens through ``Strategy``
(``from_pretrained``, ``create_optimizer``: FusedAdam, ``prepare``, ``backward``,
``optimizer_step``). ``--warmup`` steps, then ``--steps`` steps timed between two accelerator
synchronisations. Prints one JSON line: tokens/s, model FLOPs per token, achieved TFLOP/s and MFU
against ``--peak_tflops`` (989: the H200's dense bf16 peak; a bf16 matmul measured ~790 on one).

Model FLOPs per token (PaLM, appendix B): 6 * N + 12 * L * H * S, with N the parameters less the
input embedding (``lm_head`` included: it is a matmul), L layers, H hidden size, S sequence
length; attention is counted in full (not halved for the causal mask), recomputation not at all.
Target: MFU >= 40% on one H200. ``--tiny``: a small config and a few steps, to check the script on
a CPU (no MFU there).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig

FULL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="small config, few steps (CPU check)")
    parser.add_argument("--micro", type=int, default=None, help="micro batch (default 8; tiny 2)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (2048; tiny 128)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (10; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (3; tiny 1)")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--peak_tflops", type=float, default=989.0)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    defaults = (2, 128, 3, 1) if args.tiny else (8, 2048, 10, 3)
    for name, value in zip(("micro", "seq", "steps", "warmup"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def model_config(args) -> LlamaConfig:
    return LlamaConfig(**(TINY if args.tiny else FULL), max_position_embeddings=args.seq,
                       tie_word_embeddings=False)


def flops_per_token(model, config: LlamaConfig, seq: int) -> tuple[int, int]:
    """(FLOPs per token, N): 6 * N + 12 * L * H * S, N without the input embedding."""
    n = sum(p.numel() for p in model.parameters())
    n -= model.get_input_embeddings().weight.numel()
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq
    return 6 * n + attention, n


def train_steps(strategy, engine, batch: dict, count: int) -> float:
    """``count`` optimizer steps; seconds between two synchronisations."""
    accelerator = get_accelerator()
    accelerator.synchronize()
    start = time.perf_counter()
    for _ in range(count * strategy.accumulation_steps):
        loss = engine(**batch).loss
        strategy.backward(loss, engine)
        strategy.optimizer_step(engine)
    accelerator.synchronize()
    return time.perf_counter() - start


def main() -> None:
    args = parse()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = StrategyConfig(zero_stage=2, bf16=True, micro_train_batch_size=args.micro,
                            train_batch_size=args.micro * world)
    with DeepSpeedStrategy(config, OptimConfig(learning_rate=1e-4)) as strategy:
        strategy.setup_distributed()
        device = get_accelerator().device_name()
        hf_config = model_config(args)
        with torch.device(device):  # built where it trains: a 1.2B init on the CPU is slow
            model = strategy.from_pretrained(hf_config, attn_implementation=args.attention)
        per_token, n = flops_per_token(model, hf_config, args.seq)
        total = sum(p.numel() for p in model.parameters())
        engine = strategy.prepare((model, strategy.create_optimizer(model), None))
        ids = torch.randint(0, hf_config.vocab_size, (args.micro, args.seq),
                            generator=torch.Generator().manual_seed(strategy.rank)).to(device)
        batch = {"input_ids": ids, "labels": ids}
        train_steps(strategy, engine, batch, args.warmup)
        seconds = train_steps(strategy, engine, batch, args.steps)
        tokens = args.micro * args.seq * strategy.accumulation_steps * world * args.steps
        report(strategy, args, device, total, n, per_token, tokens, seconds)


def report(strategy, args, device: str, total: int, n: int, per_token: int, tokens: int,
           seconds: float) -> None:
    tflops = tokens * per_token / seconds / 1e12
    on_cuda = device == "cuda"
    strategy.print(json.dumps({
        "model": "tiny" if args.tiny else "llama-1.1b", "device": device,
        "gpu": torch.cuda.get_device_name() if on_cuda else None,
        "zero_stage": 2, "dtype": "bf16", "attention": args.attention,
        "world_size": strategy.world_size, "micro_batch": args.micro, "seq_len": args.seq,
        "timed_steps": args.steps, "warmup_steps": args.warmup,
        "params_total": total, "params_n": n,
        "formula": "6*N + 12*L*H*S per token; N = params less the input embedding "
                   "(lm_head included), attention in full, no recompute",
        "flops_per_token": per_token, "seconds": round(seconds, 4),
        "step_ms": round(seconds / args.steps * 1e3, 2),
        "tokens_per_s": round(tokens / seconds, 1), "achieved_tflops": round(tflops, 3),
        "peak_tflops": args.peak_tflops,
        "mfu": round(tflops / args.peak_tflops, 4) if on_cuda else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_cuda
        else None,
    }))


if __name__ == "__main__":
    main()
