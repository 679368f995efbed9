"""Pure functions from a StrategyConfig (and world size) to DeepSpeed config dicts."""

from __future__ import annotations

import copy

from strategy.config.strategy_config import StrategyConfig


def deep_merge(base: dict, override: dict) -> dict:
    """Merge ``override`` into a copy of ``base``, recursively (override wins).

    Args:
        base: the mapping to start from; left unchanged.
        override: the mapping whose values win; nested dicts merge key by key.

    Returns:
        A new dict; neither argument is modified.
    """
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _precision(cfg: StrategyConfig) -> dict:
    out = {"bf16": {"enabled": cfg.bf16}}
    if cfg.fp16:
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    return out


def _batch(cfg: StrategyConfig, world_size: int, micro: int) -> dict:
    """DeepSpeed checks ``train_batch_size == micro x accumulation x ranks``, counting ranks as
    the world over the sequence-parallel size (Ulysses' mpu says so) but the whole world under
    AutoTP (its groups are made after the check): the samples per step are ours either way."""
    accum = cfg.accumulation_steps(world_size)
    counted = cfg.data_parallel_size(world_size) * cfg.tensor_parallel_size
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * counted}


def build_ds_config(cfg: StrategyConfig, world_size: int) -> dict:
    """The DeepSpeed training config: ZeRO, offload, precision, clipping, batch sizes, overrides.

    Args:
        cfg: the validated strategy config.
        world_size: the number of ranks.

    Returns:
        The config dict for ``deepspeed.initialize``, ``ds_config_overrides`` merged in last.

    Raises:
        ConfigError: the world size does not fit ``cfg``'s parallel sizes or batch sizes.
    """
    cfg.validate_world(world_size)
    zero = {
        "stage": cfg.zero_stage,
        "overlap_comm": cfg.overlap_comm,
        "offload_optimizer": {"device": "cpu" if cfg.adam_offload else "none", "pin_memory": True},
        "offload_param": {"device": "cpu" if cfg.param_offload else "none", "pin_memory": True},
    }
    if cfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if cfg.adam_offload and cfg.offload_ratio < 1:
        zero["offload_optimizer"]["ratio"] = cfg.offload_ratio
    if cfg.zpg > 1:
        zero["zero_hpz_partition_size"] = cfg.zpg
    out = {
        **_batch(cfg, world_size, cfg.micro_train_batch_size),
        "steps_per_print": 10**9,  # our own logging reports; DeepSpeed's would duplicate it
        "zero_optimization": zero,
        "gradient_clipping": cfg.max_norm,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # ZeRO-Offload with a client optimizer other than DeepSpeedCPUAdam (HybridAdam) is refused
        # without it
        **({"zero_force_ds_cpu_optimizer": False} if cfg.adam_offload else {}),
        **_precision(cfg),
    }
    if cfg.grad_accum_dtype:
        out["data_types"] = {"grad_accum_dtype": cfg.grad_accum_dtype}
    if cfg.tensor_parallel_size > 1:
        # the output layer stays whole: every loss (DPO's log-softmax too) sees full logits
        out["tensor_parallel"] = {"autotp_size": cfg.tensor_parallel_size,
                                  "vocab_parallel_lm_head": False}
    return deep_merge(out, cfg.ds_config_overrides)


def build_eval_ds_config(cfg: StrategyConfig, world_size: int) -> dict:
    """Config for inference-only engines (e.g. a DPO reference): ZeRO-3 if training is ZeRO-3 or
    ``ref_offload`` keeps them on the CPU (parameters fetched layer by layer per forward), else 0.

    Args:
        cfg: the validated strategy config.
        world_size: the number of ranks.

    Returns:
        The config dict; of the overrides only the ``zero_optimization.stage3_*`` keys apply.
    """
    stage = 3 if cfg.zero_stage == 3 or cfg.ref_offload else 0
    offload = cfg.param_offload or cfg.ref_offload
    zero = {"stage": stage,
            "offload_param": {"device": "cpu" if offload else "none", "pin_memory": True}}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    out = {
        **_batch(cfg, world_size, cfg.micro_eval_batch_size),
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        **_precision(cfg),
    }
    zero_overrides = cfg.ds_config_overrides.get("zero_optimization", {})
    keep = {k: v for k, v in zero_overrides.items() if k.startswith("stage3_")}
    return deep_merge(out, {"zero_optimization": keep} if stage == 3 and keep else {})
