"""Parameter groups: weight decay on everything but biases and normalization weights."""

from __future__ import annotations

from deepspeed import DeepSpeedEngine
from torch import nn

from strategy.internals import norm_base_classes

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm, *norm_base_classes())
# Names of norm modules across HF families: model.norm, input_layernorm, ln_f, ln_1, q_norm, ...
NORM_NAME_HINTS = ("norm", "ln_")
Named = list[tuple[str, nn.Parameter]]


def is_norm_module(name: str, module: nn.Module) -> bool:
    """A normalization layer, by type (LayerNorm, RMSNorm, LlamaRMSNorm...) or by name."""
    if isinstance(module, NORM_TYPES) or "norm" in type(module).__name__.lower():
        return True
    leaf = name.rsplit(".", 1)[-1].lower()
    return any(leaf.startswith(hint) or hint in leaf for hint in NORM_NAME_HINTS)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose parameters to optimize. Only DeepSpeed engines are unwrapped: a Hugging
    Face ``XForCausalLM.model`` is the backbone without ``lm_head``, never the whole model."""
    return model.module if isinstance(model, DeepSpeedEngine) else model


def split_decay_params(model: nn.Module) -> tuple[Named, Named]:
    """Split the trainable parameters into those with and without weight decay.

    Args:
        model: a module or DeepSpeed engine.

    Returns:
        (decay, no_decay) lists of (name, param); biases and norm weights have no decay, each
        parameter appears once.
    """
    decay, no_decay, seen = [], [], set()
    for mod_name, module in unwrap_model(model).named_modules():
        norm = is_norm_module(mod_name, module)
        for p_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            is_bias = p_name == "bias" or p_name.endswith("_bias")
            (no_decay if norm or is_bias else decay).append((full, param))
    return decay, no_decay


def get_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups; an empty group is dropped (it breaks DeepSpeed's LR scheduler).

    Args:
        model: a module or DeepSpeed engine.
        weight_decay: the decay of the decayed group.

    Returns:
        Groups of ``params``, ``weight_decay`` and ``names`` (the parameters' names).

    Raises:
        ValueError: no parameter requires a gradient.
    """
    decay, no_decay = split_decay_params(model)
    groups = [
        {"params": [p for _, p in decay], "weight_decay": weight_decay,
         "names": [n for n, _ in decay]},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0,
         "names": [n for n, _ in no_decay]},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model has no trainable parameters (requires_grad=False everywhere); "
                         "unfreeze some or check the LoRA target_modules")
    return groups
