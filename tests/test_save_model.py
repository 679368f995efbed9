"""``save_model`` at 2 ranks on the real engine: HF directories that reload to the trained weights.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from tests.support.helpers import gathered_state, make_strategy
from tests.support.models import FAMILIES, VOCAB, tiny_llama, token_batches
from tests.support.readonly import read_only_view

SHARD = "20KB"  # tiny models are ~100 KB in fp32: forces 5-8 shards


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def train_steps(s, engine, steps: int = 2) -> None:
    for x in token_batches(steps, 2 * s.world_size, seed=3):
        x = x[s.rank * 2 : (s.rank + 1) * 2]
        for _ in range(s.accumulation_steps):
            s.backward(engine(input_ids=x, labels=x).loss, engine)
            s.optimizer_step(engine)


def check_shards(out: Path, max_bytes: int, min_shards: int = 3) -> None:
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= min_shards, files
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == files
    seen = {}
    for f in files:
        with safe_open(out / f, "pt") as sf:
            keys = list(sf.keys())
            sizes = [sf.get_slice(k).get_shape() for k in keys]
            nbytes = sum(sf.get_tensor(k).nbytes for k in keys)
        assert nbytes <= max_bytes or len(keys) == 1, f"{f}: {nbytes} bytes > {max_bytes}"
        seen.update({k: f for k in keys})
        assert all(0 not in shape for shape in sizes), f"{f} holds an empty tensor"
    assert seen == index["weight_map"]


def reference_model(config, state: dict[str, torch.Tensor], dtype=torch.float32):
    """A fresh single-process model holding the training model's gathered weights."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    result = ref.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not result.unexpected_keys and all("lm_head" in k for k in result.missing_keys), result
    return ref


def export_roundtrip(stage: int, family: str, root: str) -> dict:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from strategy.export.shards import parse_size

    s = make_strategy(stage)
    config = FAMILIES[family]()
    model = s.from_pretrained(config)
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine)
    out = Path(root) / f"{family}-zero{stage}"
    # only rank 0 writes: rank 1 sees root read-only, so any write of its own (Python or native)
    # fails with EROFS and the save raises on every rank
    with read_only_view(root) if s.rank == 1 else nullcontext():
        s.save_model(engine, tiny_tokenizer(), out, max_shard_size=SHARD)
    state = gathered_state(engine)
    s.close()
    if s.rank == 1:
        return {}
    check_shards(out, parse_size(SHARD))
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    assert [p.name for p in Path(root).iterdir() if p.name.startswith(".")] == [], (
        "temporary directory left"
    )
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ref = reference_model(config, state)
    for name, value in state.items():
        assert torch.equal(loaded.state_dict()[name], value), f"{name} differs after reload"
    if config.tie_word_embeddings:
        assert (
            loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
        ), "not tied"
    x = token_batches(1, 2, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref(x).logits), (
            "reloaded logits differ from the trained weights"
        )
    # the generic class: AutoTokenizer would pick the family's own tokenizer class for qwen2
    assert PreTrainedTokenizerFast.from_pretrained(out)("t1 t2 t3")["input_ids"] == [1, 2, 3]
    return {"files": sorted(p.name for p in out.iterdir())}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_export_reloads_identically(ranks, tmp_path, stage, family):
    out = ranks.run(export_roundtrip, stage, family, str(tmp_path))
    assert "model.safetensors.index.json" in out[0]["files"]


# ------------------------------------------------------------------ LoRA
def _base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base model's weights under plain HF names, from a PeftModel's gathered state."""
    out = {}
    for k, v in state.items():
        if "lora_" in k or ".modules_to_save." in k:
            continue
        out[
            k.removeprefix("base_model.model.")
            .replace(".base_layer.", ".")
            .replace(".original_module.", ".")
        ] = v
    return out


def lora_roundtrip(root: str) -> dict:
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    s = make_strategy(3, bf16=True, lr=5e-2)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["lm_head"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(s.from_pretrained(tiny_llama()), lora, autocast_adapter_dtype=False)
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine, steps=3)
    adapter_dir, merged_dir = Path(root) / "adapter", Path(root) / "merged"
    with read_only_view(root) if s.rank == 1 else nullcontext():  # only rank 0 writes
        s.save_model(engine, None, adapter_dir)
        s.save_model(engine, None, merged_dir, max_shard_size="30KB", merge_lora=True)
    x = token_batches(1, 2, seed=7)[0]
    engine.eval()
    with torch.no_grad():
        engine_logits = engine(input_ids=x).logits.float()
    state = gathered_state(engine)
    s.close()
    if s.rank == 1:
        return {}
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert all("lora_" in k or "lm_head" in k for k in adapter), sorted(adapter)[:5]
    assert any("lora_B" in k for k in adapter) and any("lm_head" in k for k in adapter)
    assert all(v.numel() > 0 and v.dtype == torch.bfloat16 for v in adapter.values()), (
        "empty or wrong-dtype tensor"
    )
    assert not any(".base_layer." in k or "embed_tokens" in k for k in adapter), (
        "frozen base weights saved"
    )
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 0, (
        "adapter never trained"
    )

    base = reference_model(tiny_llama(), _base_state(state), torch.bfloat16)
    reloaded = PeftModel.from_pretrained(base, adapter_dir, autocast_adapter_dtype=False).eval()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value.float(), state[name]), f"{name} differs after reload"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.bfloat16 and not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        peft_logits = reloaded(input_ids=x).logits.float()
        merged_logits = merged(input_ids=x).logits.float()
    assert torch.equal(peft_logits, engine_logits), (peft_logits - engine_logits).abs().max()
    # merged weights round W + BA to bf16 once (8-bit mantissa), the unmerged forward rounds W x and
    # B A x separately: logits agree to a few bf16 ulps of their magnitude
    gap = (merged_logits - engine_logits).abs().max().item() / engine_logits.abs().max().item()
    assert gap < MERGED_RTOL, f"merged logits differ by {gap:.2e} (relative to max |logit|)"
    return {"merged_gap": gap}


MERGED_RTOL = 3e-2


@pytest.mark.slow
def test_lora_zero3_bf16_adapter_and_merged(ranks, tmp_path):
    out = ranks.run(lora_roundtrip, str(tmp_path))
    print(f"merged vs training logits: max relative gap {out[0]['merged_gap']:.2e}")


def dtype_frozen_and_failure(root: str) -> dict:
    from safetensors import safe_open

    s = make_strategy(3)
    model = s.from_pretrained(tiny_llama())
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen parameters are exported too
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine)
    out = Path(root) / "bf16"
    s.save_model(engine, None, out, max_shard_size="1GB", dtype="bf16")
    state = gathered_state(engine)
    blocker = Path(root) / "a-file"
    if s.is_rank_0:
        blocker.write_text("not a directory")
    s.barrier()
    with pytest.raises(
        RuntimeError, match="failed on rank 0"
    ) as err:  # every rank raises, none hangs
        s.save_model(engine, None, blocker)
    s.close()
    if not s.is_rank_0:
        return {}
    assert "output_dir" in str(err.value.__cause__)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as sf:
        assert sorted(sf.keys()) == sorted(state)
        for k in sf.keys():
            assert torch.equal(sf.get_tensor(k), state[k].to(torch.bfloat16)), k
    return {}


@pytest.mark.slow
def test_dtype_frozen_params_and_rank0_failure(ranks, tmp_path):
    ranks.run(dtype_frozen_and_failure, str(tmp_path))
