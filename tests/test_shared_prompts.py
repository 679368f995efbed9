"""GRPO/PPO's shared prompt forward (``losses.shared_prompts``): each distinct prompt of a
micro-batch runs once and its completions run on its KV cache, giving the per-row forward's
log-probs, gradients and critic values, laid out alike, on three families and a LoRA model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from strategy.trainers.losses import shared_prompts, token_logps, token_values
from tests.support.models import FAMILIES

PAD = 0


def _rows() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 1 to 9 tokens, repeated 1 to 4 times and interleaved (not in runs), with
    completions of 1 to 20 tokens."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (1, 9, 4, 6)]
    order = [0, 1, 2, 1, 0, 3, 1, 2, 1, 0]  # prompt 3 alone; prompt 1 four times
    lengths = [20, 1, 7, 13, 2, 5, 11, 1, 3, 16]
    completions = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
    return [prompts[i] for i in order], completions


def _batch(prompts: list[list[int]], completions: list[list[int]]) -> dict:
    """The padded micro-batch GRPO builds (prompt + completion per row, right-padded)."""
    ids = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, ids))
    return {"input_ids": torch.tensor([x + [PAD] * (width - len(x)) for x in ids]),
            "labels": torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c))
                                    for p, c in zip(prompts, completions)]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    lora = family == "llama_lora"
    extra = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else {}
    config = FAMILIES["llama" if lora else family](initializer_range=0.3, **extra)  # peaked:
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")  # positions
    # matter; no dropout, so the two forwards can be compared in training mode
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():  # a trained adapter, not peft's zero-init B
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
    return model.train()


def _forwards(model: torch.nn.Module) -> list[int]:
    """Rows of each forward of ``model``'s transformers model, recorded as they run."""
    rows: list[int] = []
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.register_forward_pre_hook(lambda _, args, kw: rows.append(
        int(kw["input_ids"].shape[0])), with_kwargs=True)
    return rows


def _logps_and_grads(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, list]:
    model.zero_grad()
    logp, mask = token_logps(model, batch, temperature=0.7)
    (logp * torch.linspace(0, 1, logp.numel()).reshape(logp.shape)).sum().backward()
    return logp.detach(), mask, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "llama_lora"])
def test_shared_prompt_forward_equals_the_per_row_one(family):
    """Log-probs at a sampling temperature and their gradients: one forward of the 4 distinct
    prompts, one of the 10 completions on their cache, equal to the 10 rows' forward."""
    prompts, completions = _rows()
    padded = _batch(prompts, completions)
    keys = shared_prompts(prompts, completions, PAD)
    assert keys["prefix_ids"].shape == (4, 9) and keys["suffix_ids"].shape == (10, 20)
    assert keys["prefix_index"].tolist() == [0, 1, 2, 1, 0, 3, 1, 2, 1, 0]
    assert keys["suffix_position_ids"][1, :3].tolist() == [9, 10, 11]
    shared = {**padded, **keys}
    model = _model(family)
    rows = _forwards(model)
    want, want_mask, want_grads = _logps_and_grads(model, padded)
    got, mask, grads = _logps_and_grads(model, shared)
    assert rows == [10, 4, 10]  # per row; then the prompts once, the completions on their cache
    assert torch.equal(mask, want_mask) and int(mask.sum()) == sum(map(len, completions))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[~mask] == 0).all()
    assert len(grads) == len(want_grads) > 0
    for a, b in zip(grads, want_grads):  # float rounding, relative to the gradient's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()))
    with torch.no_grad():  # the reference's way: no graph
        torch.testing.assert_close(token_logps(model, shared, 0.7)[0], want, rtol=1e-5, atol=1e-5)


def test_shared_prompt_critic_values_and_where_rows_forward_alone():
    """A critic's values on the shared forward equal the per-row ones; a batch whose prompts
    are all distinct gets no keys; a model under gradient checkpointing forwards per row (its
    recomputation would fill the cache twice) and still gives the same log-probs."""
    prompts, completions = _rows()
    padded, keys = _batch(prompts, completions), shared_prompts(prompts, completions, PAD)
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_config(
        FAMILIES["llama"](num_labels=1, initializer_range=0.3, classifier_dropout=0.0))
    rows = _forwards(critic)
    values, mask = token_values(critic, {**padded, **keys})
    want, want_mask = token_values(critic, padded)
    assert rows == [4, 10, 10] and torch.equal(mask, want_mask)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)

    assert shared_prompts([[5], [6, 7], [5, 6]], [[8], [9], [10]], PAD) == {}
    model = _model("llama")
    model.gradient_checkpointing_enable()
    rows = _forwards(model)
    got = _logps_and_grads(model, {**padded, **keys})
    assert rows == [10]
    model.gradient_checkpointing_disable()
    want = _logps_and_grads(model, padded)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
