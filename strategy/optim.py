"""Parameter groups (no decay on biases and norm weights) and the optimizer factory."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from strategy.config import OPTIMIZERS, fail

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
if hasattr(nn, "RMSNorm"):
    NORM_TYPES = NORM_TYPES + (nn.RMSNorm,)
# Names of norm modules across HF families: model.norm, input_layernorm, ln_f, ln_1, q_norm, ...
NORM_NAME_HINTS = ("norm", "ln_")


def is_norm_module(name: str, module: nn.Module) -> bool:
    """A normalization layer, by type (LayerNorm, RMSNorm, LlamaRMSNorm...) or by name."""
    if isinstance(module, NORM_TYPES) or "norm" in type(module).__name__.lower():
        return True
    leaf = name.rsplit(".", 1)[-1].lower()
    return any(leaf.startswith(h) or h in leaf for h in NORM_NAME_HINTS)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose parameters to optimize. Only DeepSpeed engines are unwrapped: a Hugging
    Face ``XForCausalLM.model`` is the backbone without ``lm_head``, never the whole model."""
    from deepspeed import DeepSpeedEngine

    return model.module if isinstance(model, DeepSpeedEngine) else model


def split_decay_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(decay, no_decay) lists of (name, param); trainable params only, each param once."""
    decay, no_decay, seen = [], [], set()
    for mod_name, module in unwrap_model(model).named_modules():
        norm = is_norm_module(mod_name, module)
        for p_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            (no_decay if norm or p_name == "bias" or p_name.endswith("_bias") else decay).append((full, param))
    return decay, no_decay


def get_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups; an empty group is dropped (it breaks DeepSpeed's LR scheduler)."""
    decay, no_decay = split_decay_params(model)
    groups = [
        {"params": [p for _, p in decay], "weight_decay": weight_decay, "names": [n for n, _ in decay]},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0, "names": [n for n, _ in no_decay]},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model has no trainable parameters (requires_grad=False everywhere); "
                         "unfreeze some or check the LoRA target_modules")
    return groups


def build_optimizer(groups: Iterable[dict], *, offload: bool, lr: float, betas: tuple[float, float],
                    eps: float, name: str = "fused_adam") -> torch.optim.Optimizer:
    """``name`` picks the kernel: fused_adam is DeepSpeed's FusedAdam, or DeepSpeedCPUAdam when optimizer
    states live on CPU (``offload``); cpu_adam is always DeepSpeedCPUAdam; hybrid_adam is ``HybridAdam``."""
    groups = [{k: v for k, v in g.items() if k != "names"} for g in groups]
    if name == "hybrid_adam":
        from strategy.hybrid_adam import HybridAdam

        return HybridAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    if name == "cpu_adam" or (name == "fused_adam" and offload):
        from deepspeed.accelerator import get_accelerator

        if not offload and get_accelerator().device_name() != "cpu":
            fail("optimizer", name, "DeepSpeedCPUAdam steps CPU tensors only; set --adam_offload, "
                 "or use fused_adam or hybrid_adam")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    if name != "fused_adam":
        fail("optimizer", name, f"use one of {', '.join(OPTIMIZERS)}")
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
