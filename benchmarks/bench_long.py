"""Long sequences at 2 ranks: the longest sequence that trains in a fixed per-rank memory budget
(sequence parallelism and the tiled logits loss, on or off), and useful tokens/s on mixed-length
data (padding-free packing vs padded batches vs transformers' Trainer padded and flattened).

python benchmarks/bench_long.py memory [--budget_gb 3.0] [--sizes 1 2]
python benchmarks/bench_long.py throughput [--rounds 3] [--steps 8] [--nproc 2]
    [--attention sdpa|flash_attention_2] [--ours_only]

memory: one job per setting (sp 1/2 x tiled on/off), the same model (LLaMA, hidden 256, 4
layers, vocabulary 32000, fp32, ZeRO-2); each job trains one step per sequence length, growing
x1.25 from 512, and records each rank's peak RSS for that step alone (the peak is reset before
it); the longest length whose peak stays in the budget on every rank. Target: sp=2 trains at
least 1.8x the length of sp=1.

throughput: one 2-rank job, 6 ways taking turns over the same rows (lengths 16-512), the same
optimizer kernel and schedule on every way, the first steps of each run skipped, useful
(non-padding) tokens/s, median and spread over rounds. Ours pack two ways: the dataset into rows
of <= 2048 first (``--pack_dataset``: "packed" below), or each micro-batch of 8 samples into one
row (``--packing_samples``, OpenRLHF's meaning); both run sdpa per sample
(``sdpa_varlen``, what ``--packing_samples`` loads on sdpa); transformers' ways run its sdpa (the
flattened rows with the block-diagonal mask transformers builds from their position ids; the
padded rows from the same right-padding collator as ours), and once more flattened on our
``sdpa_varlen``, so the kernel's share and the loop's share of the gain are told apart.
Targets: packed >= 1.5x padded, >= 1.5x transformers' DataCollatorWithFlattening, and >= 1.3x
transformers' Trainer with padded batches. On one GPU: ``--nproc 1`` (NCCL puts one rank on a
GPU; the global batch stays the same, by accumulation), ``--attention flash_attention_2`` for our
two ways where flash-attn is installed (packed rows then take its varlen path), ``--ours_only``
for our three ways alone.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import statistics
import subprocess
import sys

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 32000, "max_position_embeddings": 65536}


# ------------------------------------------------------------ memory: one probe job per setting


def _reset_peak() -> None:
    """Start a new peak-RSS window for this process (Linux: clear_refs 5 resets VmHWM)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as fh:
        line = next(row for row in fh if row.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def probe(sp: int, tiled: bool, budget: float) -> None:
    """Inside torchrun: one step per length, growing until a rank's step peak passes the budget."""
    import torch
    from transformers import LlamaConfig

    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
    from strategy.trainers.losses import forward_inputs, tiled_loss_sum

    config = StrategyConfig(zero_stage=2, sequence_parallel_size=sp, micro_train_batch_size=1,
                            train_batch_size=2 // sp)
    with DeepSpeedStrategy(config, OptimConfig(learning_rate=1e-4)) as strategy:
        strategy.setup_distributed()
        torch.manual_seed(0)
        values = {k: v for k, v in MODEL.items() if k != "model_type"}
        model = strategy.from_pretrained(LlamaConfig(**values), attn_implementation="sdpa")
        engine = strategy.prepare((model, strategy.create_optimizer(model), None))
        length, results = 512, []
        while True:
            ids = torch.randint(0, MODEL["vocab_size"], (1, length),
                                generator=torch.Generator().manual_seed(strategy.rank))
            batch = strategy.shard_sequence({"input_ids": ids, "labels": ids})
            _reset_peak()
            if tiled:
                most = int(strategy.all_reduce(batch["input_ids"].numel(), op="max"))
                total = tiled_loss_sum(engine, batch, 1024, most)
            else:
                inputs = forward_inputs(batch)
                targets = batch["shift_labels"] if sp > 1 else batch["labels"]
                inputs.update(labels=targets, **({"shift_labels": targets} if sp > 1 else {}))
                total = engine(**inputs, num_items_in_batch=1).loss
            strategy.backward(total / length, engine)
            strategy.optimizer_step(engine)
            peak = strategy.all_reduce(_peak_bytes(), op="max")
            results.append((length, peak))
            if peak > budget:
                break
            length = int(length * 1.25) // 64 * 64
        strategy.print("RESULT " + json.dumps(results))


def run_probe(sp: int, tiled: bool, budget: float, port: int) -> list:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(port), __file__, "probe", "--sp", str(sp),
               "--tiled", str(int(tiled)), "--budget_gb", str(budget / 1e9)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    line = [row for row in proc.stdout.splitlines() if row.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"probe sp={sp} tiled={tiled} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


def memory(budget: float, sizes: list[int]) -> None:
    port = 29700
    longest = {}
    for sp in sizes:
        for tiled in (False, True):
            results = run_probe(sp, tiled, budget, port)
            port += 1
            fits = [length for length, peak in results if peak <= budget]
            longest[(sp, tiled)] = max(fits) if fits else 0
            steps = ", ".join(f"{length}:{peak / 1e9:.2f}" for length, peak in results)
            print(f"sp={sp} tiled={int(tiled)}: longest in {budget / 1e9:.1f} GB = "
                  f"{longest[(sp, tiled)]} tokens   (length:peak GB per rank {steps})", flush=True)
    if sizes != [1, 2]:
        return
    for tiled in (False, True):
        ratio = longest[(2, tiled)] / max(longest[(1, tiled)], 1)
        print(f"tiled={int(tiled)}: sp=2 / sp=1 longest = {ratio:.2f}x (target >= 1.8x)")
    print(f"sp=1: tiled / plain longest = {longest[(1, True)] / max(longest[(1, False)], 1):.2f}x")


# ------------------------------------------------------------ throughput: one job, 4 ways


def mixed_rows(count: int, seed: int = 0) -> list[dict]:
    """Prompt/response rows of 16-512 tokens (uniform), as SFT tokenizes them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        length = rng.randint(16, 512)
        prompt = rng.randint(4, length // 4 + 4)
        ids = [rng.randrange(3, 13) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def throughput(rounds: int, steps: int, nproc: int = 2, attention: str = "sdpa",
               ours_only: bool = False) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", "29790", __file__, "throughput_job", "--rounds", str(rounds),
               "--steps", str(steps), "--attention", attention]
    command += ["--ours_only"] if ours_only else []
    subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)


def throughput_job(rounds: int, steps: int, attention: str = "sdpa",
                   ours_only: bool = False) -> None:
    """Inside torchrun: the five ways in turns (our two alone with ``ours_only``), each with the
    micro batch that gives it about 2048 positions per micro-batch (4 padded rows of <= 512, one
    packed row of <= 2048, or 8 flattened rows of 264 tokens on average); our ways on
    ``attention`` (packed rows on its per-sample form)."""
    from common import run_ours, run_theirs, spread
    from transformers import DataCollatorWithFlattening, LlamaConfig

    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig, attention_for
    from strategy.trainers import data as sft_data
    from strategy.trainers.data import packing

    rows = mixed_rows(2048)
    packed = packing.pack(rows, 2048)
    values = {k: v for k, v in MODEL.items() if k != "model_type"} | {"vocab_size": 16}
    model_config = LlamaConfig(**values)
    flatten = DataCollatorWithFlattening(return_position_ids=True)
    varlen = attention_for("sdpa", True)
    ours = attention_for(attention, True)
    ways = {"ours, padded": ("ours", rows, sft_data.collate_sft(0), 4, attention),
            f"ours, packed ({ours})": ("ours", packed, packing.collate_packed(0), 1, ours),
            f"ours, --packing_samples ({ours})": ("ours", rows, packing.collate_micro_batch(0), 8,
                                                 ours),
            "transformers, padded": ("theirs", rows, sft_data.collate_sft(0), 4, "sdpa"),
            "transformers, DataCollatorWithFlattening": ("theirs", rows, flatten, 8, "sdpa"),
            "transformers, flattening + our sdpa_varlen": ("theirs", rows, flatten, 8, varlen)}
    if ours_only:
        ways = dict(list(ways.items())[:3])
    figures = {name: [] for name in ways}
    skip = 2
    for round_number in range(rounds + 1):  # round 0 warms every way up
        for name, (side, data, collate, micro, attention) in ways.items():
            config = StrategyConfig(zero_stage=2, micro_train_batch_size=micro,
                                    train_batch_size=micro * 2)
            with DeepSpeedStrategy(config, OptimConfig(learning_rate=1e-4)) as strategy:
                strategy.setup_distributed()
                args = (strategy, model_config, data, collate, micro, steps, skip)
                if side == "theirs":
                    run = run_theirs(*args, "/tmp/bench_hf", attention)
                else:
                    run = run_ours(*args, attention)
            if round_number:
                figures[name].append(run)
    for name, values in figures.items():
        strategy.print(f"{name:<42}: {spread(values)} useful tokens/s")
    packed_figures = figures[f"ours, packed ({ours})"]
    for other, target in (("ours, padded", 1.5), (f"ours, --packing_samples ({ours})", None),
                          ("transformers, DataCollatorWithFlattening", 1.5),
                          ("transformers, padded", 1.3),
                          ("transformers, flattening + our sdpa_varlen", None)):
        if other not in figures:
            continue
        ratios = [a / b for a, b in zip(packed_figures, figures[other])]  # per round, paired
        aim = f"; target >= {target}x" if target else "; the same attention kernel"
        aim = "; dataset packing vs per micro-batch" if "packing_samples" in other else aim
        strategy.print(f"packed / {other:<42}: {statistics.median(ratios):.2f}x "
                       f"(per round {min(ratios):.2f}-{max(ratios):.2f}{aim})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["memory", "throughput", "probe", "throughput_job"])
    parser.add_argument("--budget_gb", type=float, default=3.0)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--tiled", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2],
                        help="memory: the sequence-parallel sizes to probe")
    parser.add_argument("--nproc", type=int, default=2, help="throughput: ranks (1 on one GPU)")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "flash_attention_2"],
                        help="throughput: our ways' attention (packed: its per-sample form)")
    parser.add_argument("--ours_only", action="store_true",
                        help="throughput: our packed and padded ways only")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if args.mode == "memory":
        memory(args.budget_gb * 1e9, sorted(args.sizes))
    elif args.mode == "probe":
        probe(args.sp, bool(args.tiled), args.budget_gb * 1e9)
    elif args.mode == "throughput":
        throughput(args.rounds, args.steps, args.nproc, args.attention, args.ours_only)
    else:
        throughput_job(args.rounds, args.steps, args.attention, args.ours_only)


if __name__ == "__main__":
    main()
