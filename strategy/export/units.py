"""What an export writes: a list of units, each naming the parameters to gather (under ZeRO-3)
and the tensors it produces from them once gathered.

Three kinds: the full model (every parameter and persistent buffer, tied ones once), a PEFT
adapter (only the adapter tensors and ``modules_to_save``, named as peft saves them), and a
merged model (each LoRA layer's base weight plus its delta, under the base model's names).
Every rank builds the same list in the same order, so every rank enters the same gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper, get_peft_model_state_dict
from torch import nn

from strategy.export.shards import TensorSpec
from strategy.internals import full_numel, full_shape, non_persistent_buffers
from strategy.model import active_adapter, unique_state_tensors


@dataclass
class Unit:
    """Tensors produced together from one set of gathered parameters."""

    params: list[nn.Parameter]
    specs: list[TensorSpec]
    produce: Callable[[], dict[str, torch.Tensor]]

    @property
    def gather_bytes(self) -> int:
        return sum(full_numel(p) * p.element_size() for p in self.params)


def out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` converts floating tensors only; integer buffers keep theirs."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _single(name: str, tensor: torch.Tensor, dtype: torch.dtype | None,
            gather: bool = True) -> Unit:
    params = [tensor] if gather and isinstance(tensor, nn.Parameter) else []
    spec = TensorSpec(name, full_shape(tensor), out_dtype(tensor, dtype))
    return Unit(params, [spec], lambda: {name: tensor})


def full_units(module: nn.Module, dtype: torch.dtype | None) -> list[Unit]:
    return [_single(name, tensor, dtype) for name, tensor in unique_state_tensors(module)]


def adapter_units(peft_model: nn.Module, dtype: torch.dtype | None) -> list[Unit]:
    """Only what ``get_peft_model_state_dict`` keeps, found by passing it placeholders: the base
    model's frozen weights are never gathered."""
    real = dict(peft_model.state_dict(keep_vars=True))
    placeholders = {name: torch.empty(0) for name in real}
    owner = {id(v): name for name, v in placeholders.items()}
    kept = get_peft_model_state_dict(peft_model, state_dict=placeholders,
                                     adapter_name=active_adapter(peft_model))
    return [_single(saved, real[owner[id(v)]], dtype) for saved, v in kept.items()]


def merged_units(peft_model: nn.Module, dtype: torch.dtype | None) -> list[Unit]:
    """The base model's tensors with every LoRA delta added, walking modules so each LoRA layer's
    base weight and adapter are gathered together (and nothing else with them)."""
    adapter = active_adapter(peft_model)
    units: list[Unit] = []
    seen: set[int] = set()
    _walk(peft_model.get_base_model(), "", adapter, dtype, units, seen)
    return units


def _walk(module: nn.Module, prefix: str, adapter: str, dtype, units: list[Unit],
          seen: set[int]) -> None:
    if isinstance(module, ModulesToSaveWrapper):
        _walk(module.modules_to_save[adapter], prefix, adapter, dtype, units, seen)
        return
    if isinstance(module, LoraLayer):
        units.append(_lora_unit(module, prefix, adapter, dtype, seen))
        return
    for name, tensor in _own_tensors(module):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            units.append(_single(prefix + name, tensor, dtype))
    for name, child in module.named_children():
        _walk(child, f"{prefix}{name}.", adapter, dtype, units, seen)


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
    skip = non_persistent_buffers(module)
    return out + [(name, buffer) for name, buffer in module.named_buffers(recurse=False)
                  if buffer is not None and name not in skip]


def _lora_unit(layer: nn.Module, prefix: str, adapter: str, dtype, seen: set[int]) -> Unit:
    if getattr(layer, "use_dora", {}).get(adapter, False):
        raise ValueError("merge_lora=True does not support DoRA adapters: save the adapter "
                         "(merge_lora=False)")
    base = layer.get_base_layer()
    tensors = [(n, t) for n, t in _own_tensors(base) if id(t) not in seen]
    seen.update(id(t) for _, t in tensors)
    params = [p for _, p in tensors if isinstance(p, nn.Parameter)]
    params += list(_adapter_params(layer, adapter))
    specs = [TensorSpec(prefix + n, full_shape(t), out_dtype(t, dtype)) for n, t in tensors]

    def produce() -> dict[str, torch.Tensor]:
        out = {prefix + n: t for n, t in tensors}
        if any(n == "weight" for n, _ in tensors) and adapter in layer.scaling:
            # added in fp32; the writer rounds once to the output dtype
            out[prefix + "weight"] = base.weight.float() + layer.get_delta_weight(adapter).float()
        return out

    return Unit(params, specs, produce)


def _adapter_params(layer: nn.Module, adapter: str):
    for attr in layer.adapter_layer_names:
        container = getattr(layer, attr, None)
        if container is not None and adapter in container:
            item = container[adapter]
            yield from ([item] if isinstance(item, nn.Parameter) else item.parameters())
