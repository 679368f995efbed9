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
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("configs")
    toy_root(root, n_train=512, n_test=16, model_dir="model")  # packed 8 a row, > 2 batches
    return root


def _out(toy, script: str, config: str, extra: tuple = ()) -> str:
    """Each example, config and flags write to a directory of their own."""
    flags = "".join(extra).replace("--", "-").replace("/", "_")
    return f"{toy}/out/{script}-{os.path.basename(config)}{flags}"


def run_example(script: str, config: str, toy: str, extra: tuple = ()) -> dict:
    from tests.support.helpers import load_example

    data, out = f"{toy}/data", _out(toy, script, config, extra)
    pairs = script in ("train_rm", "train_dpo", "train_orpo", "train_simpo", "train_kto")
    train, held = ("pairs_train", "pairs_test") if pairs else ("train", "test")
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
    return load_example(script)(argv + [a.replace("TOY", toy) for a in extra])


CONFIGS = [
    ("train_sft", "configs/sft_zero2.yaml", ()),
    ("train_sft", "configs/sft_zero3.yaml", ()),
    ("train_sft", "configs/sft_zero3_lora_offload.yaml", ()),
    ("train_rm", "configs/rm_zero2.yaml", ()),
    ("train_dpo", "configs/dpo_zero3.yaml", ()),
    ("train_dpo", "configs/dpo_zero3.yaml", ("--ref_pretrain", "TOY/model")),  # OpenRLHF's
    ("train_orpo", "configs/orpo_zero2.yaml", ()),
    ("train_simpo", "configs/simpo_zero3.yaml", ()),
    ("train_kto", "configs/kto_zero3.yaml", ()),
    # the extension example in the settings it claims: packing, sequence parallelism, ZeRO-3
    ("custom_trainer", "configs/sft_zero2.yaml", ("--packing_samples",)),
    ("custom_trainer", "configs/sft_zero2.yaml", ("--sequence_parallel_size", "2")),
    ("custom_trainer", "configs/sft_zero3.yaml", ()),
    ("train_sft", "configs/grpo_sft.yaml", ()),
    ("train_grpo", "configs/grpo_toy.yaml", ()),
    ("train_grpo", "configs/reinforce_pp_toy.yaml", ()),
    ("train_ppo", "configs/ppo_toy.yaml", ()),
    ("train_distill", "configs/distill_toy.yaml", ("--teacher_pretrain", "TOY/model")),
]


@pytest.mark.parametrize(
    "script,config,extra",
    CONFIGS,
    ids=[f"{s}:{os.path.basename(c)}{''.join(e)}" for s, c, e in CONFIGS],
)
def test_shipped_config_runs(ranks, toy, script, config, extra):
    final = ranks.run(run_example, script, config, str(toy), extra)[0]
    assert final and all(torch.isfinite(torch.tensor(v)) for v in final.values()), final
    out = Path(_out(toy, script, config, extra))
    rows = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3], "3 optimizer steps"
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    assert any((out / "model" / name).is_file() for name in weights), sorted(out.iterdir())
    if script == "custom_trainer":  # the focal loss ran: below the plain cross-entropy it weighs
        train = [r for r in rows if "train/loss" in r]
        assert all(0 < r["train/loss"] < r["train/ce"] for r in train), train
        assert 0 < final["loss"] < final["ce"], final


def test_config_and_example_headers_name_real_files():
    """The commands a config or example starts with name scripts, configs and modules that
    exist (a header once named an examples/toy_task.py that did not)."""
    import importlib.util
    import re

    root = Path(__file__).resolve().parents[1]
    missing = []
    for path in [*root.glob("configs/*.yaml"), *root.glob("examples/*.py"),
                 *root.glob("examples/*.sh")]:
        header = "".join(line for line in open(path) if line.startswith(("#", "  ", '"""')))
        header += open(path).read().split('"""')[1] if path.suffix == ".py" else ""
        for name in re.findall(r"\b((?:examples|configs)/[\w./]+\.(?:py|yaml|sh|json))", header):
            if not (root / name).is_file():
                missing.append(f"{path.name}: {name}")
        for module in re.findall(r"python -m (strategy[\w.]*)", header):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{path.name}: {module}")
    assert not missing, missing
