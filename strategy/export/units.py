"""What an export writes: a list of units, each naming the parameters to gather (under ZeRO-3)
and the tensors it produces from them once gathered.

Three kinds: the full model (every parameter and persistent buffer, tied ones once), a PEFT
adapter (only the adapter tensors and ``modules_to_save``, named as peft saves them), and a
merged model (each LoRA layer's base weight plus its delta, under the base model's names).
Every rank builds the same list in the same order, so every rank enters the same gathers.
``plan_export`` picks the kind and plans the shards: ``save_model`` and the offline export share it,
so both write the same files in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from strategy.errors import ConfigError
from strategy.export.shards import ShardPlan, ShardWriter, TensorSpec, parse_size, plan_shards
from strategy.internals import full_numel, full_shape, non_persistent_buffers
from strategy.model import active_adapter, is_peft_model, unique_state_tensors
from strategy.quant import is_four_bit


@dataclass
class Unit:
    """Tensors produced together from one set of gathered parameters. ``sources`` are all the
    module's tensors ``produce`` reads (``params`` and buffers): what the offline export fills from
    a checkpoint."""

    params: list[nn.Parameter]
    specs: list[TensorSpec]
    produce: Callable[[], dict[str, torch.Tensor]]
    sources: list[torch.Tensor]

    @property
    def gather_bytes(self) -> int:
        return sum(full_numel(p) * p.element_size() for p in self.params)

    def write(self, writer: ShardWriter) -> None:
        """Produce the tensors (``params`` gathered) and append them to their shards."""
        produced = self.produce()
        for spec in self.specs:
            writer.write(spec.name, produced[spec.name])


@dataclass
class ExportPlan:
    """What an export writes: units in write order, which shard each tensor goes to, the file
    prefix (``model`` or ``adapter_model``)."""

    units: list[Unit]
    shards: ShardPlan
    prefix: str
    adapter_only: bool


def plan_export(module: nn.Module, dtype: torch.dtype | None, max_shard_size: int | str,
                merge_lora: bool) -> ExportPlan:
    """The full model, or for a PEFT model its adapter (in one file: peft reads one) or with
    ``merge_lora`` the merged model; planned from shapes alone."""
    peft = is_peft_model(module)
    if merge_lora and not peft:
        raise ConfigError("merge_lora=True needs a PEFT model: "
                          "pass merge_lora=False for a plain model")
    if merge_lora and is_four_bit(module):
        raise ConfigError("merge_lora=True is invalid for a 4-bit (QLoRA) base: a merge would "
                          "re-quantise it; export the adapter and merge it onto the "
                          "full-precision base (peft's merge_and_unload)")
    if peft and not merge_lora:
        units, prefix, limit = adapter_units(module, dtype), "adapter_model", float("inf")
    else:
        units = merged_units(module, dtype) if peft else full_units(module, dtype)
        prefix, limit = "model", parse_size(max_shard_size)
    shards = plan_shards([spec for unit in units for spec in unit.specs], limit)
    return ExportPlan(units, shards, prefix, peft and not merge_lora)


def out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` converts floating tensors only; integer buffers keep theirs."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _single(name: str, tensor: torch.Tensor, dtype: torch.dtype | None,
            gather: bool = True) -> Unit:
    params = [tensor] if gather and isinstance(tensor, nn.Parameter) else []
    spec = TensorSpec(name, full_shape(tensor), out_dtype(tensor, dtype))
    return Unit(params, [spec], lambda: {name: tensor}, [tensor])


def full_units(module: nn.Module, dtype: torch.dtype | None) -> list[Unit]:
    return [_single(name, tensor, dtype) for name, tensor in unique_state_tensors(module)]


def adapter_units(peft_model: nn.Module, dtype: torch.dtype | None) -> list[Unit]:
    """Only what ``get_peft_model_state_dict`` keeps, found by passing it placeholders: the base
    model's frozen weights are never gathered."""
    from peft.utils import get_peft_model_state_dict  # a PEFT model: peft is loaded

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
    from peft.tuners.lora import LoraLayer  # a PEFT model's walk: peft is loaded
    from peft.utils import ModulesToSaveWrapper  # likewise

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
        raise ConfigError("merge_lora=True does not support DoRA adapters: save the adapter "
                          "(merge_lora=False)")
    base = layer.get_base_layer()
    tensors = [(n, t) for n, t in _own_tensors(base) if id(t) not in seen]
    seen.update(id(t) for _, t in tensors)
    adapter_params = list(_adapter_params(layer, adapter))
    params = [p for _, p in tensors if isinstance(p, nn.Parameter)] + adapter_params
    specs = [TensorSpec(prefix + n, full_shape(t), out_dtype(t, dtype)) for n, t in tensors]

    def produce() -> dict[str, torch.Tensor]:
        out = {prefix + n: t for n, t in tensors}
        if any(n == "weight" for n, _ in tensors) and adapter in layer.scaling:
            # added in fp32; the writer rounds once to the output dtype
            out[prefix + "weight"] = base.weight.float() + layer.get_delta_weight(adapter).float()
        return out

    return Unit(params, specs, produce, [t for _, t in tensors] + adapter_params)


def _adapter_params(layer: nn.Module, adapter: str):
    for attr in layer.adapter_layer_names:
        container = getattr(layer, attr, None)
        if container is not None and adapter in container:
            item = container[adapter]
            yield from ([item] if isinstance(item, nn.Parameter) else item.parameters())
