"""strategy.decode: the rollout's lean sampling loop gives ``generate``'s tokens (greedy and sampled
from one seed), on the conventions of real checkpoints, while ended rows leave the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from strategy.decode import decode
from strategy.model import base_model
from strategy.rollout import prefill_groups

VOCAB, GROUP, NEW = 32, 3, 10


def _llama(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, initializer_range=0.3)).eval()  # peaked: positions matter


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, bos_token_id=2, eos_token_id=2)).eval()


def _lora() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # a trained adapter, not peft's zero-init B
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def _prompts(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of very different lengths (1 to 9 tokens), GROUP copies of each."""
    lengths = [1, 9, 4, 6, 2]
    width, g = max(lengths), torch.Generator().manual_seed(3)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids.repeat_interleave(GROUP, 0), mask.repeat_interleave(GROUP, 0)


def _hf(model, ids, mask, config: GenerationConfig, seed: int) -> torch.Tensor:
    base_model(model).generation_config = GenerationConfig()  # nothing of the checkpoint's own
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def _ours(model, ids, mask, config: GenerationConfig, seed: int, group: int) -> torch.Tensor:
    cache = prefill_groups(model, ids, mask, group) if group > 1 else None
    assert (cache is not None) == (group > 1)
    torch.manual_seed(seed)
    return decode(model, ids, mask, config, cache)


MODELS = {"llama": _llama, "llama_tied": lambda: _llama(tied=True), "gpt2": _gpt2, "lora": _lora}
SAMPLING = {"greedy": {"do_sample": False},
            "t0.7": {"do_sample": True, "temperature": 0.7},
            "t1.3_topk5_topp0.8": {"do_sample": True, "temperature": 1.3, "top_k": 5,
                                   "top_p": 0.8}}


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_decode_gives_generates_tokens(model_name):
    """For each model, sampling setting and whether the group's prompt cache is shared: the same
    tokens as ``generate`` from the same seed with (a) no end-of-sequence id (every row runs
    ``NEW`` steps), (b) pad == eos, one id, (c) a list of end ids (an end-of-turn beside EOS)
    chosen from (a)'s draws so that rows end at different steps and all end before ``NEW``."""
    model = MODELS[model_name]()
    ids, mask = _prompts(pad=1)
    varied = []  # cases where rows left the batch at different steps
    for name, sampling in SAMPLING.items():
        for group in (1, GROUP):
            seed = 11
            free = GenerationConfig(max_new_tokens=NEW, pad_token_id=1, eos_token_id=None,
                                    **sampling)
            want = _hf(model, ids, mask, free, seed)
            assert want.shape == (len(ids), ids.shape[1] + NEW)
            assert torch.equal(_ours(model, ids, mask, free, seed, group), want), (name, group)
            new = want[:, ids.shape[1]:]
            # pad == eos (a checkpoint without its own pad token): the token most drawn ends rows
            common = int(new.flatten().mode().values)
            ended = GenerationConfig(max_new_tokens=NEW, pad_token_id=common,
                                     eos_token_id=common, **sampling)
            assert torch.equal(_ours(model, ids, mask, ended, seed, group),
                               _hf(model, ids, mask, ended, seed)), (name, group, "pad==eos")
            # every row's 5th token among the end ids: all rows end by step 5, some sooner
            ends = sorted(set(new[:, 4].tolist()))
            listed = GenerationConfig(max_new_tokens=NEW, pad_token_id=0, eos_token_id=ends,
                                      **sampling)
            want = _hf(model, ids, mask, listed, seed)
            got = _ours(model, ids, mask, listed, seed, group)
            assert torch.equal(got, want), (name, group, "eos list")
            steps = [int((torch.isin(row, torch.tensor(ends))).nonzero()[0]) + 1
                     for row in got[:, ids.shape[1]:]]
            assert got.shape[1] == ids.shape[1] + max(steps) <= ids.shape[1] + 5
            varied.append(min(steps) < max(steps))
    assert any(varied), varied  # compaction ran (a degenerate greedy may end all rows at once)


def test_decode_refuses_settings_it_does_not_implement():
    model = _llama()
    ids, mask = _prompts(pad=0)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, repetition_penalty=1.3,
                              pad_token_id=0, eos_token_id=2)
    with pytest.raises(ValueError, match="repetition_penalty"):
        decode(model, ids, mask, config)


def test_rollouts_fall_back_to_generate_where_decode_cannot_run(monkeypatch):
    """A model whose cache or logits ``decode`` cannot handle generates with ``generate`` (the
    same tokens); one that can goes through ``decode``."""
    import strategy.rollout.hf as rollout

    model = _llama()
    ids, mask = _prompts(pad=1)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=0.7,
                              pad_token_id=1, eos_token_id=5)
    want = _hf(model, ids, mask, config, 3)
    calls = []
    monkeypatch.setattr(rollout, "decode", lambda *a: calls.append(1) or decode(*a))
    for can in (True, False):
        monkeypatch.setattr(rollout, "supports", lambda module, can=can: can)
        torch.manual_seed(3)
        assert torch.equal(rollout.whole_generate(model, ids, mask, config, GROUP), want)
    assert calls == [1]  # decode ran once: when the model supports it
