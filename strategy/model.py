"""Building Hugging Face models so that ZeRO-3 partitions them at construction."""

from __future__ import annotations

import json
import os
import struct
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
    if os.path.isdir(name_or_config):
        check_safetensors_dir(name_or_config)
    return auto_cls.from_pretrained(name_or_config, dtype=dtype, **kwargs)


class CorruptWeightsError(ValueError):
    """A weights file that cannot be what its header or index says: the message names the file."""


def check_safetensors_dir(path: str) -> None:
    """Before loading: every shard the index names exists, and every .safetensors file is as long as
    its header says (a truncated copy otherwise fails deep inside, or loads garbage lazily)."""
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if os.path.isfile(index):
        with open(index) as fh:
            needed = set(json.load(fh).get("weight_map", {}).values())
        missing = sorted(needed - set(files))
        if missing:
            raise CorruptWeightsError(f"{index} names missing shard(s) {missing}; re-export the model")
    for name in files:
        check_safetensors_file(os.path.join(path, name))


def check_safetensors_file(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CorruptWeightsError(f"{path}: truncated ({size} bytes, no safetensors header); re-export it")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(n)) if 8 + n <= size else None
        except ValueError:
            header = None
    if header is None:
        raise CorruptWeightsError(f"{path}: corrupt safetensors header; re-export it or restore a copy")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        raise CorruptWeightsError(f"{path}: {size} bytes but its header needs {8 + n + end} (truncated or "
                                  f"padded copy); re-export it or restore a complete copy")
