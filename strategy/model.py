"""Building Hugging Face models so that ZeRO-3 partitions them at construction."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def dtype_of(bf16: bool, fp16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def build_hf_model(name_or_config: Any, auto_cls: Any = None, dtype: torch.dtype | None = None,
                   **kwargs: Any) -> nn.Module:
    """``from_pretrained`` for a path/name, ``from_config`` for a config object. Under a live ZeRO-3
    ``HfDeepSpeedConfig`` transformers builds inside ``deepspeed.zero.Init``: each rank only ever
    materializes its own partition."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    auto_cls = auto_cls or AutoModelForCausalLM
    if isinstance(name_or_config, PretrainedConfig):
        return auto_cls.from_config(name_or_config, dtype=dtype, **kwargs)
    return auto_cls.from_pretrained(name_or_config, dtype=dtype, **kwargs)
