"""Tensor parallelism with DeepSpeed's AutoTP (``tensor_parallel.autotp_size``, ZeRO 0-2).

Ranks ``[k * tp, (k + 1) * tp)`` form a tensor-parallel group: they see the same batch and each
holds a slice of every attention and MLP projection, split by the model's transformers
tensor-parallel plan (column-wise q/k/v/gate/up, row-wise o/down, the output layer column-wise
with its logits gathered whole, so every loss sees full logits: ``vocab_parallel_lm_head`` off);
embeddings and norms stay whole. Exports
gather each layer's slices back (``internals.tensor_parallel_gathered``) and write a normal HF
directory; checkpoints hold one file per slice and resume at the same tensor-parallel size.
"""

from __future__ import annotations

from typing import Any

from strategy.errors import fail


def check_tensor_parallel(hf_config: Any, tp: int) -> None:
    """Before any process group starts: what AutoTP cannot split here, as one line each."""
    if tp == 1:
        return
    text = hf_config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        fail("tensor_parallel_size", tp, f"model_type {hf_config.model_type!r} has no tensor-"
             "parallel plan in transformers; use a LLaMA/Qwen2-style model, or size 1")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for count, what in ((heads, "attention heads"), (kv_heads, "key/value heads")):
        if count % tp:
            fail("tensor_parallel_size", tp, f"the model's {count} {what} do not divide by it; "
                 f"use a divisor of {count}")
