"""Every shipped example config runs a few steps at 2 ranks (paths pointed at generated toy data).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.demos.toy_task import make
    from strategy.trainers.recipe import hf_config

    root = tmp_path_factory.mktemp("configs")
    make(str(root / "data"), n_train=512, n_test=16)  # packed 8-to-a-row, still > 2 batches
    tok = AutoTokenizer.from_pretrained(str(root / "data" / "tokenizer"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama.json", tok)).save_pretrained(
        root / "model"
    )
    tok.save_pretrained(root / "model")
    return root


def _out(toy, script: str, config: str) -> str:
    """Each example and config pair writes to a directory of its own."""
    return f"{toy}/out/{script}-{os.path.basename(config)}"


def run_example(script: str, config: str, toy: str) -> dict:
    from tests.support.helpers import load_example

    data, out = f"{toy}/data", _out(toy, script, config)
    train = "pairs_train" if script in ("train_rm", "train_dpo") else "train"
    held = "pairs_test" if script in ("train_rm", "train_dpo") else "test"
    argv = [
        "--config",
        config,
        "--max_steps",
        "3",
        "--max_epochs",
        "10",  # so that max_steps is what stops every config
        "--logging_steps",
        "1",
        "--tokenizer",
        f"{data}/tokenizer",
        "--dataset",
        f"{data}/{train}.jsonl",
        "--eval_dataset",
        f"{data}/{held}.jsonl",
        "--save_path",
        f"{out}/model",
        "--ckpt_path",
        f"{out}/ckpt",
        "--log_dir",
        f"{out}/logs",
    ]
    if "pretrain:" in open(config).read():
        argv += ["--pretrain", f"{toy}/model"]
    return load_example(script)(argv)


CONFIGS = [
    ("train_sft", "configs/sft_zero2.yaml"),
    ("train_sft", "configs/sft_zero3.yaml"),
    ("train_sft", "configs/sft_zero3_lora_offload.yaml"),
    ("train_rm", "configs/rm_zero2.yaml"),
    ("train_dpo", "configs/dpo_zero3.yaml"),
    ("custom_trainer", "configs/sft_zero2.yaml"),
    ("train_sft", "configs/grpo_sft.yaml"),
    ("train_grpo", "configs/grpo_toy.yaml"),
]


@pytest.mark.parametrize(
    "script,config", CONFIGS, ids=[f"{s}:{os.path.basename(c)}" for s, c in CONFIGS]
)
def test_shipped_config_runs(ranks, toy, script, config):
    final = ranks.run(run_example, script, config, str(toy))[0]
    assert final and all(torch.isfinite(torch.tensor(v)) for v in final.values()), final
    out = Path(_out(toy, script, config))
    rows = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3], "3 optimizer steps"
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    assert any((out / "model" / name).is_file() for name in weights), sorted(out.iterdir())
