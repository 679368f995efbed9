"""Hugging Face models: building them so ZeRO-3 partitions them at construction, telling PEFT
models apart, and listing a model's tensors with tied ones once."""

from __future__ import annotations

import os
from typing import Any

import torch
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from strategy.checkpoint.safe_load import check_safetensors_dir

IGNORE_INDEX = -100  # transformers' label for tokens that are not scored (prompt, padding)


def build_hf_model(name_or_config: Any, auto_cls: Any = None, dtype: torch.dtype | None = None,
                   **kwargs: Any) -> nn.Module:
    """``from_pretrained`` for a path/name, ``from_config`` for a config object. Under a live
    ZeRO-3 ``HfDeepSpeedConfig`` transformers builds inside ``deepspeed.zero.Init``: each rank only
    ever materializes its own partition. A local directory's weights are checked first."""
    auto_cls = auto_cls or AutoModelForCausalLM
    if isinstance(name_or_config, PretrainedConfig):
        return auto_cls.from_config(name_or_config, dtype=dtype, **kwargs)
    if os.path.isdir(name_or_config):
        check_safetensors_dir(name_or_config)
    return auto_cls.from_pretrained(name_or_config, dtype=dtype, **kwargs)


def is_peft_model(module: nn.Module) -> bool:
    return isinstance(module, PeftModel)


def active_adapter(peft_model: nn.Module) -> str:
    """The one active adapter of a PEFT model (exports write one)."""
    names = list(peft_model.active_adapters)
    if len(names) != 1:
        raise ValueError(f"model has active adapters {names}: set one with model.set_adapter(name) "
                         "before saving")
    return names[0]


def base_model(module: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper, or ``module`` itself."""
    return module.get_base_model() if is_peft_model(module) else module


def unique_state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers in ``state_dict`` order; a tied tensor only under its
    first name, which is the one transformers keeps (``lm_head.weight`` is dropped in favour of
    the embedding)."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out
