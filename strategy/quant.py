"""QLoRA: a base model's linear layers loaded in 4-bit NF4 through bitsandbytes (transformers'
``BitsAndBytesConfig``), prepared by PEFT for k-bit training; only LoRA adapters train.

The packed 4-bit weights are stored in the training dtype (``bnb_4bit_quant_storage``), so ZeRO-3
partitions them like any other frozen parameter and DeepSpeed's dtype cast leaves their bytes
alone. transformers never builds a quantised model inside ``zero.Init``: each rank loads the whole
4-bit model and ``deepspeed.initialize`` partitions it afterwards. bitsandbytes is the optional
``qlora`` extra.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn
from transformers import BitsAndBytesConfig

from strategy.errors import fail


def check_four_bit(pretrain: str | None, lora_rank: int, param_offload: bool,
                   tensor_parallel_size: int) -> None:
    """What ``--load_in_4bit`` needs, checked before any process group starts.

    Args:
        pretrain: the ``--pretrain`` checkpoint (quantisation loads weights; it cannot build
            fresh ones).
        lora_rank: the LoRA rank (4-bit weights do not train; adapters do).
        param_offload: ZeRO-3 parameter offload (it would move the packed weights as numbers).
        tensor_parallel_size: AutoTP ranks (it would split the packed weights as numbers).

    Raises:
        ConfigError: one line naming the setting and the fix.
    """
    if not lora_rank:
        fail("load_in_4bit", True, "4-bit weights do not train; add --lora_rank R (QLoRA)")
    if pretrain is None:
        fail("load_in_4bit", True, "quantisation loads a checkpoint's weights; pass --pretrain "
             "MODEL_DIR (not --model_config)")
    if importlib.util.find_spec("bitsandbytes") is None:
        fail("load_in_4bit", True, "bitsandbytes is not installed; pip install '.[qlora]'")
    if param_offload:
        fail("param_offload", True, "4-bit weights cannot be offloaded by ZeRO-3; drop "
             "--param_offload (--adam_offload still holds the adapters' optimizer states on CPU)")
    if tensor_parallel_size > 1:
        fail("tensor_parallel_size", tensor_parallel_size, "AutoTP cannot split 4-bit weights; "
             "use ZeRO-3 with --load_in_4bit instead")


def four_bit_config(dtype: torch.dtype) -> Any:
    """NF4 with double quantisation, computing and storing in ``dtype``.

    Args:
        dtype: the training dtype (bf16, fp16 or fp32).

    Returns:
        The ``BitsAndBytesConfig`` for ``from_pretrained(quantization_config=...)``.
    """
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_quant_storage=dtype)


def prepare_four_bit(model: nn.Module, gradient_checkpointing: bool) -> nn.Module:
    """PEFT's k-bit preparation: non-quantised weights in fp32, inputs that carry gradients into
    checkpointed layers.

    Args:
        model: a model loaded with ``four_bit_config``.
        gradient_checkpointing: whether the run checkpoints activations.

    Returns:
        The prepared model, ready for ``apply_lora``.
    """
    from peft import prepare_model_for_kbit_training  # 4-bit runs only (peft loads bnb, ~1 s)

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)


def is_four_bit(model: nn.Module) -> bool:
    """Whether any layer of ``model`` holds 4-bit weights.

    Args:
        model: a model, PEFT-wrapped or not.

    Returns:
        True when a ``Linear4bit`` (bitsandbytes) is among its modules.
    """
    return any(type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")
               for m in model.modules())
