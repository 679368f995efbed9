"""The one map between dtype names (configs, CLI flags, safetensors headers) and torch dtypes."""

from __future__ import annotations

import torch

from strategy.errors import ConfigError

BY_NAME = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# safetensors' dtype codes for what an export may hold
SAFETENSORS_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                     torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                     torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def resolve_dtype(dtype: torch.dtype | str | None, field: str = "dtype") -> torch.dtype | None:
    """A torch dtype from a name (``bf16``, ``float32``...), a dtype, or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in BY_NAME:
        raise ConfigError(f"{field}={dtype!r} is invalid: use one of {sorted(BY_NAME)} "
                          "or a torch.dtype")
    return BY_NAME[dtype]


def training_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The dtype a model trains in under the precision flags."""
    if bf16:
        return torch.bfloat16
    return torch.float16 if fp16 else torch.float32
