"""Tiny model configs of three families whose parameter names and saving differ."""

from __future__ import annotations

import json

import torch

VOCAB = 96


def tiny_llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        **{
            **dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            ),
            **kw,
        }
    )


def tiny_gpt2(**kw):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        tie_word_embeddings=True,
        **kw,
    )


def tiny_qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **kw,
    )


FAMILIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": tiny_qwen2}


def token_batches(n: int, batch: int, seq: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def tool_caller(root, steps: int = 60, out: str = "sft") -> None:
    """The tool-use example's data in ``root/data`` and, in ``root/out``, its tiny model after a
    short SFT on conversations that call the calculator (plain torch, one process, ~10 s): its
    greedy turns are well-formed calls (of the wrong numbers, mostly), so episodes have tool
    turns; a model from its config alone never calls a tool."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.demos.toy_tools import make
    from strategy.trainers.run import hf_config

    make(str(root / "data"), n_train=512, n_test=13, seed=1)
    tok = AutoTokenizer.from_pretrained(str(root / "data/tokenizer"))
    rows = [json.loads(line) for line in open(root / "data/tool_sft.jsonl")]
    chats = [tok.apply_chat_template(r["messages"], return_dict=False) for r in rows]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama_tools.json", tok))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        batch = chats[step * 32 % len(chats):][:32]
        n = max(map(len, batch))
        ids = torch.tensor([c + [tok.pad_token_id] * (n - len(c)) for c in batch])
        labels = torch.tensor([c + [-100] * (n - len(c)) for c in batch])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(root / out)
    tok.save_pretrained(root / out)
