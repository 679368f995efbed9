"""Tokens/s of SFTTrainer vs Hugging Face ``transformers.Trainer`` with the same DeepSpeed config,
model, data and batch, at 2 ranks, in one run (after a warm-up, alternating rounds).

deepspeed --num_gpus 2 tests/benchmarks/bench_sft.py [--steps 30] [--zero_stage 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig  # noqa: E402
from strategy.demos.toy_task import make_tokenizer  # noqa: E402
from strategy.trainers import SFTTrainer, TrainConfig  # noqa: E402
from strategy.trainers import data as ds  # noqa: E402
from strategy.trainers.config import DataConfig  # noqa: E402
from strategy.trainers.recipe import hf_config  # noqa: E402

MODEL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}


def data_file(tmp: str, n: int) -> str:
    rng = random.Random(0)
    path = os.path.join(tmp, "train.jsonl")
    with open(path, "w") as fh:
        for _ in range(n):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(20, 60)))
            fh.write(json.dumps({"input": word + "=", "output": word[::-1]}) + "\n")
    return path


class Timed(SFTTrainer):
    """Records the wall time of each optimizer step (after a warm-up) and the tokens it trained on.
    """

    def compute_loss(self, batch: dict):
        self.tokens = getattr(self, "tokens", 0) + int(batch["attention_mask"].sum())
        return super().compute_loss(batch)


def run_ours(s, model_cfg, tok, rows, steps: int, micro: int) -> float:
    model = s.from_pretrained(model_cfg)
    collate = ds.collate_sft(tok.pad_token_id)
    loader = s.setup_dataloader(rows, micro, shuffle=True, collate_fn=collate)
    opt = s.create_optimizer(model)
    sched = s.create_scheduler(opt, num_training_steps=steps, num_warmup_steps=0)
    cfg = TrainConfig(
        model_config="x", max_steps=steps, logging_steps=steps, log_dir=None, save_path="/dev/null"
    )
    trainer = Timed(s, model, opt, sched, loader, None, cfg, tok)
    trainer.save_model = lambda path: None  # time training only
    start = time.perf_counter()
    trainer.fit()
    elapsed = s.all_reduce(time.perf_counter() - start, "max")
    return s.all_reduce(trainer.tokens, "sum") / elapsed


def run_hf(s, model_cfg, tok, rows, steps: int, micro: int, out: str) -> float:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_config(model_cfg)
    collate = ds.collate_sft(tok.pad_token_id)
    counted = {"tokens": 0}

    def counting_collate(batch):
        out_batch = collate(batch)
        counted["tokens"] += int(out_batch["attention_mask"].sum())
        return out_batch

    ds_cfg = dict(s.ds_config)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=micro,
        max_steps=steps,
        gradient_accumulation_steps=s.accumulation_steps,
        learning_rate=s.optim.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        deepspeed=ds_cfg,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        seed=1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=counting_collate)
    start = time.perf_counter()
    trainer.train()
    elapsed = s.all_reduce(time.perf_counter() - start, "max")
    return s.all_reduce(counted["tokens"], "sum") / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--zero_stage", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    micro = 8
    s = DeepSpeedStrategy(
        StrategyConfig(
            zero_stage=args.zero_stage, micro_train_batch_size=micro, train_batch_size=micro * 2 * 2
        ),
        OptimConfig(learning_rate=1e-4),
    )
    s.setup_distributed()
    tmp = tempfile.mkdtemp() if s.is_rank_0 else ""
    tmp = s.all_gather(torch.tensor([ord(c) for c in tmp.ljust(64)]))[:64]
    tmp = "".join(chr(int(c)) for c in tmp).strip()
    if s.is_rank_0:
        make_tokenizer(os.path.join(tmp, "tok"))
        data_file(tmp, 4096)
    s.barrier()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(tmp, "tok"))
    rows = ds.load_sft(os.path.join(tmp, "train.jsonl"), tok, DataConfig(max_len=128))
    model_cfg = hf_config_from_dict(MODEL, tok)
    run_ours(s, model_cfg, tok, rows, 5, micro)  # warm-up: first-use costs hit neither measurement
    ours, hfs = [], []
    for _ in range(args.rounds):  # alternate so drift hits both
        ours.append(run_ours(s, model_cfg, tok, rows, args.steps, micro))
        try:
            hfs.append(run_hf(s, model_cfg, tok, rows, args.steps, micro, os.path.join(tmp, "hf")))
        except Exception as e:  # noqa: BLE001 - report why HF's Trainer could not run here
            s.print(f"HF Trainer failed on this machine: {type(e).__name__}: {str(e)[:300]}")
    mean = sum(ours) / len(ours)
    hf = sum(hfs) / len(hfs) if hfs else None
    s.print(
        f"zero_stage={args.zero_stage} world={s.world_size} steps={args.steps} micro={micro} "
        f"accum={s.accumulation_steps}"
    )
    s.print(
        f"SFTTrainer           : {mean:9.0f} tokens/s (runs: {', '.join(f'{x:.0f}' for x in ours)})"
    )
    if hf is not None:
        s.print(
            f"transformers.Trainer : {hf:9.0f} tokens/s "
            f"(runs: {', '.join(f'{x:.0f}' for x in hfs)})"
        )
        s.print(f"ratio ours/HF        : {mean / hf:.3f}  (target >= 1.0)")
    s.close()


def hf_config_from_dict(values: dict, tok):
    path = os.path.join(tempfile.mkdtemp(), "model.json")
    with open(path, "w") as fh:
        json.dump(values, fh)
    return hf_config(path, tok)


if __name__ == "__main__":
    main()
