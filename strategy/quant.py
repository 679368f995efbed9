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

from strategy.dist import print0
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

    note_missing_kernels()
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)


def note_missing_kernels() -> None:
    """The note bitsandbytes would print at import on an AVX512-BF16 CPU (silenced there, in
    ``strategy.errors``, for every run that is not 4-bit), said once by a 4-bit run."""
    if (not torch.cuda.is_available() and importlib.util.find_spec("kernels") is None
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512")):
        print0("note: bitsandbytes' faster CPU 4-bit matmul needs the optional `kernels` "
               "package (pip install 'kernels>=0.11.1'); it falls back to its own")


def keep_storage_layout(model: nn.Module) -> nn.Module:
    """Keep every 4-bit layer's weights in the layout they were loaded in.

    On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit`` repacks its weight into a CPU
    inference layout at its first forward in eval mode without gradients (an evaluation, a
    reference model's log-probs): the forward then computes in another precision than training
    does (logits off by ~2e-3), a ZeRO-3 partition is repacked as if whole, and ``state_dict``
    fails on weights stored in the training dtype (bitsandbytes 0.50: it asserts uint8). Turning
    that path off keeps one layout and one numeric path for training, evaluation and export.

    Args:
        model: a model, 4-bit or not (others are returned unchanged).

    Returns:
        ``model``.
    """
    for module in model.modules():
        if _is_linear4bit(module):
            module.support_avx512bf16_for_cpu = False
    return model


def _is_linear4bit(module: nn.Module) -> bool:
    return (type(module).__name__ == "Linear4bit"
            and type(module).__module__.startswith("bitsandbytes"))


def is_four_bit(model: nn.Module) -> bool:
    """Whether any layer of ``model`` holds 4-bit weights.

    Args:
        model: a model, PEFT-wrapped or not.

    Returns:
        True when a ``Linear4bit`` (bitsandbytes) is among its modules.
    """
    return any(_is_linear4bit(m) for m in model.modules())
