"""The non-weight files of an HF directory: ``config.json`` (+ ``generation_config.json``),
``adapter_config.json`` for a PEFT model, the tokenizer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strategy.model import active_adapter, base_model, is_peft_model


def write_adapter_config(module: nn.Module, out: Path) -> None:
    config = copy.deepcopy(module.peft_config[active_adapter(module)])
    config.inference_mode = True
    config.save_pretrained(str(out))


def write_model_config(base: nn.Module, out: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.dtype = dtype
    config.save_pretrained(str(out))
    generation = getattr(base, "generation_config", None)
    if generation is not None and base.can_generate():
        generation.save_pretrained(str(out))


def write_export_metadata(module: nn.Module, tokenizer: Any, out: Path, adapter_only: bool,
                          dtype: torch.dtype) -> None:
    """What ``save_model`` writes beside the weights."""
    if adapter_only:
        write_adapter_config(module, out)
    else:
        write_model_config(base_model(module), out, dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def save_model_metadata(model: nn.Module, directory: str | Path, tokenizer: Any = None) -> None:
    """What ``python -m strategy.export`` needs beside a DeepSpeed checkpoint: the base model's
    ``config.json`` (+ ``generation_config.json``), ``adapter_config.json`` for a PEFT model, the
    tokenizer's files. No collectives: call it on the rank that writes (rank 0).

    Args:
        model: the trained model or its DeepSpeed engine (PEFT or not).
        directory: where to write; created if missing.
        tokenizer: saved beside the config when given.
    """
    module = getattr(model, "module", model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    base = base_model(module)
    write_model_config(base, out, next(base.parameters()).dtype)
    if is_peft_model(module):
        write_adapter_config(module, out)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
