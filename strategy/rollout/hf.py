"""The rollout engines that generate with the policy's own weights in ``transformers``: the
training engine's module (``EngineRollout``) or a plain gathered copy (``GatheredRollout``); see
the package's docstring."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn
from transformers import DynamicCache, GenerationConfig

from strategy.decode import decode, supports
from strategy.errors import ConfigError
from strategy.export.save import gathered_params, group_units, tensor_parallel_owners
from strategy.export.units import plan_export
from strategy.internals import full_numel, is_zero3_param, with_cache
from strategy.model import base_model, is_peft_model

GATHER_MODES = ("full", "layer")


class RolloutEngine(Protocol):
    """What a trainer generates with: ``sync`` after the policy changed, then ``generate``
    (left-padded ``input_ids``, their ``attention_mask``, a ``GenerationConfig`` of the fields
    ``strategy.decode`` reads, and ``group``: rows come in runs of ``group`` copies of one
    prompt); every rank calls both alike. It returns what ``transformers``' ``generate`` would."""

    def sync(self) -> None: ...

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1) -> torch.Tensor: ...


def whole_generate(module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   generation_config: GenerationConfig, group: int) -> torch.Tensor:
    """Generation by a module whole on this rank: ``decode`` on the group's shared prompt cache
    (``generate`` itself for a model whose cache or logits ``decode`` cannot handle)."""
    cache = prefill_groups(module, input_ids, attention_mask, group)
    if not supports(module):
        return module.generate(input_ids=input_ids, attention_mask=attention_mask,
                               **with_cache(cache),
                               generation_config=generation_config, use_cache=True)
    return decode(module, input_ids, attention_mask, generation_config, cache)


def prefill_groups(module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   group: int, agree: Callable[[bool], bool] = bool) -> DynamicCache | None:
    """The KV cache of every row's prompt but its last token, run once per ``group`` identical
    rows and repeated to each of them, for ``generate(cache=...)``: it then runs only the last
    prompt token and the new ones. None (a plain ``generate``) where nothing is shared: groups of
    one, one-token prompts, rows that are not runs of one prompt, a model whose generation needs
    another cache than transformers' dynamic one or whose forward cannot keep only the last
    logits. Position ids count the prompt's tokens from 0, as ``generate``'s do.

    Args:
        module: the model that generates (a PEFT model or a ZeRO-3 engine's module too).
        input_ids: left-padded prompts, ``group`` consecutive copies of each.
        attention_mask: their mask.
        group: copies per prompt.
        agree: whether every rank shares (ranks in a partitioned forward must all run it).

    Returns:
        The cache, or None.
    """
    model = base_model(module)
    rows, width = input_ids.shape
    ok = group > 1 and width > 1 and rows % group == 0 and supports(module)
    unique_ids, unique_mask = input_ids[::group], attention_mask[::group]
    ok = ok and torch.equal(unique_ids.repeat_interleave(group, 0), input_ids) and torch.equal(
        unique_mask.repeat_interleave(group, 0), attention_mask)
    if not agree(ok):
        return None
    ids, mask = unique_ids[:, :-1], unique_mask[:, :-1]
    positions = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        module(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache),
               use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(group)
    return cache


def _every_rank(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (one small all-reduce)."""
    flag = torch.tensor([int(ok)], device=get_accelerator().current_device_name())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class EngineRollout:
    """The engine's module generates (ZeRO-3 at more than one rank: ``generate`` with one gather
    per layer per token, ranks in step; otherwise ``decode``)."""

    def __init__(self, engine: Any, zero3_ranks: bool) -> None:
        self.module, self.synced_gpus = engine.module, zero3_ranks

    def sync(self) -> None:
        """Nothing to refresh: the engine's own weights generate."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1) -> torch.Tensor:
        if not self.synced_gpus:
            return whole_generate(self.module, input_ids, attention_mask, generation_config,
                                  group)
        cache = prefill_groups(self.module, input_ids, attention_mask, group, _every_rank)
        return self.module.generate(input_ids=input_ids, attention_mask=attention_mask,
                                    generation_config=generation_config, **with_cache(cache),
                                    synced_gpus=True, use_cache=True)


class GatheredRollout:
    """A plain copy of a ZeRO-3 policy, refreshed by one grouped gather per rollout."""

    def __init__(self, engine: Any, build_plain: Any) -> None:
        self.source = engine.module
        template = base_model(self.source)
        self.module = build_plain(template.config, next(self.source.parameters()).dtype)
        self.module.to(get_accelerator().current_device_name()).eval()
        self.module.requires_grad_(False)
        self._state = self.module.state_dict()
        self._owner = tensor_parallel_owners(self.source)
        # planned once from shapes: each unit reads the live parameters when it produces
        plan = plan_export(self.source, None, 2**62, merge_lora=is_peft_model(self.source))
        self._groups = group_units(plan.units)

    def sync(self) -> None:
        """Every rank gathers the policy group by group and copies it into its plain module."""
        for group in self._groups:
            with gathered_params([p for unit in group for p in unit.params], self._owner):
                for unit in group:
                    for name, tensor in unit.produce().items():
                        self._state[name].copy_(tensor)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1) -> torch.Tensor:
        return whole_generate(self.module, input_ids, attention_mask, generation_config, group)


def full_weight_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters once gathered."""
    return sum(full_numel(p) * p.element_size() for p in module.parameters())


def check_fits(module: nn.Module, least_free_bytes: int) -> None:
    """``full`` needs the whole policy on every rank: refuse it when its weights exceed the
    least free memory of any rank (the caller reduces it, so every rank raises alike)."""
    need = full_weight_bytes(module)
    if need > least_free_bytes:
        raise ConfigError(f"rollout_gather='full' is invalid: a generation copy of the policy "
                          f"needs {need / 1e9:.2f} GB on every rank and one rank has "
                          f"{least_free_bytes / 1e9:.2f} GB free; use --rollout_gather layer")


def free_memory_bytes() -> int:
    """This rank's free accelerator memory (host memory on CPU)."""
    return int(get_accelerator().available_memory())


def is_partitioned(module: nn.Module) -> bool:
    return any(is_zero3_param(p) for p in module.parameters())
