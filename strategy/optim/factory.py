"""The optimizer factory: DeepSpeed's FusedAdam, DeepSpeedCPUAdam, or our HybridAdam."""

from __future__ import annotations

from typing import Iterable

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

from strategy.errors import fail
from strategy.optim.config import OPTIMIZERS
from strategy.optim.hybrid_adam import HybridAdam


def build_optimizer(groups: Iterable[dict], *, offload: bool, lr: float, betas: tuple[float, float],
                    eps: float, name: str = "fused_adam") -> torch.optim.Optimizer:
    """``name`` picks the kernel: fused_adam is DeepSpeed's FusedAdam, or DeepSpeedCPUAdam when
    optimizer states live on CPU (``offload``); cpu_adam is always DeepSpeedCPUAdam; hybrid_adam
    is ``HybridAdam``. The ops compile on first use, not here.

    Args:
        groups: parameter groups (``get_param_groups``); their ``names`` are dropped.
        offload: optimizer states live on CPU (ZeRO-Offload).
        lr: learning rate.
        betas: Adam's beta1 and beta2.
        eps: Adam's epsilon.
        name: fused_adam, cpu_adam or hybrid_adam.

    Returns:
        The optimizer, with decoupled (AdamW) weight decay.

    Raises:
        ConfigError: an unknown ``name``, or cpu_adam on an accelerator without ``offload``.
    """
    if name not in OPTIMIZERS:
        fail("optimizer", name, f"use one of {', '.join(OPTIMIZERS)}")
    groups = [{k: v for k, v in g.items() if k != "names"} for g in groups]
    if name == "hybrid_adam":
        return HybridAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    if name == "cpu_adam" or offload:
        if not offload and get_accelerator().device_name() != "cpu":
            fail("optimizer", name, "DeepSpeedCPUAdam steps CPU tensors only; set --adam_offload, "
                 "or use fused_adam or hybrid_adam")
        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
