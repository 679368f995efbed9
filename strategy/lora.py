"""LoRA adapters through peft, with target modules checked against the model first."""

from __future__ import annotations

from torch import nn

from strategy.errors import fail


def linear_leaf_names(model: nn.Module) -> set[str]:
    """Leaf names of the linear-like layers LoRA can adapt (``q_proj``, ``c_attn``, ...)."""
    kinds = ("Linear", "Conv1D")
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if name and any(kind in type(module).__name__ for kind in kinds)}


def check_targets(model: nn.Module, target_modules: str) -> str | list[str]:
    """``all-linear``, or the listed names, each of which must be a linear layer of ``model``.

    Args:
        model: the model to adapt.
        target_modules: ``all-linear`` or comma-separated leaf names such as ``q_proj,v_proj``.

    Returns:
        ``"all-linear"`` or the list of names, as peft takes them.

    Raises:
        ConfigError: a name is no linear layer of ``model`` (the message lists those there are).
    """
    if target_modules.strip() == "all-linear":
        return "all-linear"
    targets = [t.strip() for t in target_modules.split(",") if t.strip()]
    known = linear_leaf_names(model)
    missing = [t for t in targets if t not in known]
    if missing:
        fail("target_modules", target_modules, f"the model has no linear layer named {missing}; "
             f"choose from {sorted(known)} or use all-linear")
    return targets


def apply_lora(model: nn.Module, rank: int, alpha: int, dropout: float, target_modules: str,
               task_type: str = "CAUSAL_LM", modules_to_save: list[str] | None = None) -> nn.Module:
    """Wrap ``model`` in a peft LoRA model; only the adapters (and ``modules_to_save``) train.

    Args:
        model: the model to adapt.
        rank: LoRA rank r.
        alpha: LoRA alpha (the update is scaled by alpha / r).
        dropout: dropout on the adapters' input.
        target_modules: as for ``check_targets``.
        task_type: peft's task type, e.g. ``CAUSAL_LM`` or ``SEQ_CLS``.
        modules_to_save: modules trained in full beside the adapters (e.g. a score head).

    Returns:
        The peft model; adapters keep the model's dtype.

    Raises:
        ConfigError: a target module is no linear layer of ``model``.
    """
    from peft import LoraConfig, get_peft_model  # LoRA runs only (peft imports bitsandbytes)

    targets = check_targets(model, target_modules)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules=targets, task_type=task_type,
                             modules_to_save=modules_to_save)
    # autocast_adapter_dtype=False keeps adapters in the model dtype: fp32 adapters in a bf16 model
    # make DeepSpeed fail on mixed dtypes
    return get_peft_model(model, lora_config, autocast_adapter_dtype=False)
