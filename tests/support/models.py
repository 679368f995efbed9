"""Tiny model configs of three families whose parameter names and saving differ."""

from __future__ import annotations

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
