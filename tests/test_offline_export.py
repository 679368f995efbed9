"""``python -m strategy.export``: a DeepSpeed checkpoint written at 2 ranks becomes an HF directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import gathered_state, make_strategy
from tests.support.models import tiny_gpt2, tiny_llama, token_batches
from tests.test_save_model import check_shards, reference_model, tiny_tokenizer, train_steps

ROOT = Path(__file__).resolve().parents[1]


def run_export(*args: str) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run(
        [sys.executable, "-m", "strategy.export", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(env, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _checkpoint(s, engine, ckpt: Path) -> None:
    s.save_ckpt(engine, str(ckpt), tag="step2", tokenizer=tiny_tokenizer())


def tied_checkpoint_exports(stage: int, root: str) -> None:
    from transformers import AutoModelForCausalLM

    s = make_strategy(stage)
    config = tiny_gpt2()
    model = s.from_pretrained(config)
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine)
    ckpt, out = Path(root) / "ckpt", Path(root) / "hf"
    _checkpoint(s, engine, ckpt)
    state = gathered_state(engine)
    s.close()
    if not s.is_rank_0:
        return
    run_export(str(ckpt), str(out), "--max_shard_size", "20KB")
    check_shards(out, 20_000)
    assert (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr(), (
        "not tied"
    )
    x = token_batches(1, 2, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, reference_model(config, state)(x).logits)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_offline_export_tied(ranks, tmp_path, stage):
    ranks.run(tied_checkpoint_exports, stage, str(tmp_path))


def lora_checkpoint_exports(root: str) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.test_save_model import _base_state

    s = make_strategy(2, lr=5e-2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(s.from_pretrained(tiny_llama()), lora)
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine)
    ckpt = Path(root) / "ckpt"
    _checkpoint(s, engine, ckpt)
    x = token_batches(1, 2, seed=7)[0]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    state = gathered_state(engine)
    s.close()
    if not s.is_rank_0:
        return
    run_export(str(ckpt), str(Path(root) / "adapter"), "--tag", "step2")
    run_export(str(ckpt), str(Path(root) / "merged"), "--merge_lora", "--dtype", "fp32")
    assert sorted(p.name for p in (Path(root) / "adapter").glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = reference_model(tiny_llama(), _base_state(state))
    with torch.no_grad():
        adapter_logits = PeftModel.from_pretrained(base, Path(root) / "adapter").eval()(x).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(Path(root) / "merged").eval()(x).logits
    assert torch.equal(adapter_logits, logits), (adapter_logits - logits).abs().max()
    # fp32: merging reorders one addition per weight, so only float32 rounding separates them
    torch.testing.assert_close(merged_logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_offline_export_lora(ranks, tmp_path):
    ranks.run(lora_checkpoint_exports, str(tmp_path))


def test_cli_errors_name_the_fix(tmp_path):
    from strategy.errors import ConfigError
    from strategy.export.offline import find_tag

    with pytest.raises(
        ConfigError, match="holds no complete checkpoint.*pass the directory save_ckpt wrote"
    ):
        find_tag(tmp_path, None)
    with pytest.raises(ConfigError, match="tag='../../etc' is invalid"):
        find_tag(tmp_path, "../../etc")
