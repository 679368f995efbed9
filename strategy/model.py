"""Hugging Face models: building them so ZeRO-3 partitions them at construction (``ModelFactory``
holds transformers' ZeRO-3 hook), telling PEFT models apart, and listing a model's tensors with
tied ones once."""

from __future__ import annotations

import copy
import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations import deepspeed as hf_deepspeed
from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

from strategy.checkpoint.safe_load import check_safetensors_dir
from strategy.errors import ConfigError, fail
from strategy.quant import keep_storage_layout

IGNORE_INDEX = -100  # transformers' label for tokens that are not scored (prompt, padding)


def build_hf_model(name_or_config: Any, auto_cls: Any = None, dtype: torch.dtype | None = None,
                   **kwargs: Any) -> nn.Module:
    """``from_pretrained`` for a path/name, ``from_config`` for a config object. Under a live
    ZeRO-3 ``HfDeepSpeedConfig`` transformers builds inside ``deepspeed.zero.Init``: each rank only
    ever materializes its own partition. A local directory's weights are checked first; 4-bit
    layers keep their loaded layout (``quant.keep_storage_layout``)."""
    auto_cls = auto_cls or AutoModelForCausalLM
    if isinstance(name_or_config, PretrainedConfig):  # a copy: from_config sets the attention
        config = copy.deepcopy(name_or_config)  # on the config it is given, the caller's too
        return auto_cls.from_config(config, dtype=dtype, **kwargs)
    if os.path.isdir(name_or_config):
        check_safetensors_dir(name_or_config)
    model = auto_cls.from_pretrained(name_or_config, dtype=dtype, **kwargs)
    return keep_storage_layout(model) if "quantization_config" in kwargs else model


def construction_config(ds_config: dict) -> dict:
    """What ZeRO-3 construction reads: transformers checks the batch sizes without Ulysses'
    groups (over the whole world), so DeepSpeed derives the batch instead."""
    return {k: v for k, v in ds_config.items() if k != "train_batch_size"}


@contextmanager
def construction_hook(ds_config: dict | None) -> Iterator[None]:
    """transformers' ZeRO-3 construction hook for ``ds_config`` (None: no hook) inside the block,
    whatever hook was live before, and that one again after."""
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers keeps one, as a weakref
    previous = ref() if ref is not None else None
    hook = HfDeepSpeedConfig(construction_config(ds_config)) if ds_config else None
    if hook is None:
        unset_hf_deepspeed_config()
    try:
        yield
    finally:
        del hook
        if previous is not None:
            set_hf_deepspeed_config(previous)
        else:
            unset_hf_deepspeed_config()


class ModelFactory:
    """Builds the models a run trains and the frozen ones it only runs forwards through, each
    partitioned at construction when its engine runs ZeRO-3.

    transformers builds inside ``deepspeed.zero.Init`` while an ``HfDeepSpeedConfig`` is alive;
    the training config's hook is kept from the first ZeRO-3 model until ``close()``, a frozen
    model's (its eval engine's config) only while that model is built. A ``transient`` factory
    (an engine with ZeRO settings of its own, ``DeepSpeedStrategy.derive``) keeps none: it builds
    under its own stage's hook, or none, and leaves the run's hook as it found it."""

    def __init__(self, zero_stage: int, ds_config: Callable[[], dict],
                 eval_ds_config: Callable[[], dict], transient: bool = False) -> None:
        self.zero_stage, self.transient = zero_stage, transient
        self.ds_config, self.eval_ds_config = ds_config, eval_ds_config
        self._train_hook: HfDeepSpeedConfig | None = None

    def build(self, name_or_config: Any, auto_cls: Any = None, dtype: torch.dtype | None = None,
              frozen: bool = False, **kwargs: Any) -> nn.Module:
        """``build_hf_model`` under the hook the model's engine needs (none below ZeRO-3)."""
        if frozen:
            eval_config = self.eval_ds_config()
            if eval_config["zero_optimization"]["stage"] == 3:
                return self._build_frozen(eval_config, name_or_config, auto_cls, dtype, **kwargs)
        if self.transient:
            with construction_hook(self.ds_config() if self.zero_stage == 3 else None):
                return build_hf_model(name_or_config, auto_cls, dtype, **kwargs)
        if self.zero_stage == 3 and self._train_hook is None:
            self._train_hook = HfDeepSpeedConfig(construction_config(self.ds_config()))
        return build_hf_model(name_or_config, auto_cls, dtype, **kwargs)

    def _build_frozen(self, eval_config: dict, *args: Any, **kwargs: Any) -> nn.Module:
        eval_hook = HfDeepSpeedConfig(construction_config(eval_config))
        try:
            return build_hf_model(*args, **kwargs)
        finally:
            del eval_hook
            if self._train_hook is not None:
                set_hf_deepspeed_config(self._train_hook)
            else:
                unset_hf_deepspeed_config()

    def build_plain(self, config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
        """A whole, unpartitioned model of ``config`` (random weights), built outside any ZeRO-3
        hook (a generation copy); the hook is restored after."""
        if self._train_hook is not None:
            unset_hf_deepspeed_config()
        try:
            return build_hf_model(config, None, dtype)
        finally:
            if self._train_hook is not None:
                set_hf_deepspeed_config(self._train_hook)

    def close(self) -> None:
        """Drop the training hook, so later single-process loads behave normally."""
        if self._train_hook is not None:
            unset_hf_deepspeed_config()
            self._train_hook = None


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT model; peft (and the bitsandbytes it imports, ~1 s) is loaded
    only by runs that use it, and no module is a ``PeftModel`` before peft is imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def active_adapter(peft_model: nn.Module) -> str:
    """The one active adapter of a PEFT model (exports write one)."""
    names = list(peft_model.active_adapters)
    if len(names) != 1:
        raise ValueError(f"model has active adapters {names}: set one with model.set_adapter(name) "
                         "before saving")
    return names[0]


def base_model(module: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper, or ``module`` itself."""
    return module.get_base_model() if is_peft_model(module) else module


def unique_state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers in ``state_dict`` order; a tied tensor only under its
    first name, which is the one transformers keeps (``lm_head.weight`` is dropped in favour of
    the embedding)."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def hf_config(path: str, tokenizer: Any = None, **kwargs: Any):
    """An HF config from a JSON file (``model_type`` picks the class), special ids from the
    tokenizer.

    Args:
        path: the JSON file.
        tokenizer: gives the vocabulary size and the pad, eos and bos ids (None: as written).
        **kwargs: further config values.

    Returns:
        The config.

    Raises:
        ConfigError: an unknown ``model_type``.
    """
    with open(path) as fh:
        values = json.load(fh)
    kind = values.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise ConfigError(f"model_config={path!r} is invalid: model_type {kind!r} unknown; use "
                          "e.g. llama, gpt2, qwen2")
    if tokenizer is not None:
        values.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    values.update(kwargs)
    return CONFIG_MAPPING[kind](**values)


def saved_reward_scale(path: str, saved: Any) -> tuple[float, float]:
    """The ``mean`` and ``std`` of a reward model's scores as its config holds them (OpenRLHF's
    reward models save them in config.json), for ``--normalize_reward``: (score - mean) / std.
    ``saved``: the loaded config, or config.json's dict. One line naming the flag when they are
    missing."""
    values = saved if isinstance(saved, dict) else vars(saved)
    mean, std = values.get("mean"), values.get("std")
    if mean is None or not std:
        fail("normalize_reward", True, f"{path}/config.json holds no mean and std (OpenRLHF's "
             "reward models save them); drop the flag")
    return float(mean), float(std)
