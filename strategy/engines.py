"""What the facade asks of a DeepSpeed engine beyond DeepSpeed's own API: that an engine (and the
optimizer and scheduler OpenRLHF's call forms pass beside it) is a training engine's, the
engine that also unpacks as ``(engine, optimizer, scheduler)``, as OpenRLHF's ``prepare``
returns, and an engine's training states put to sleep off the device and woken again
(``--ds_enable_sleep``).

May import: ``errors``; nothing of ``strategy`` imports from here but the facade and
``check_sleep``'s callers (the RL trainers' settings checks).
"""

from __future__ import annotations

from typing import Any

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

from strategy.errors import fail

_UNPACKABLE: dict[type, type] = {}  # engine class -> its subclass with __iter__


def _engine_parts(engine: Any) -> Any:
    return iter((engine, engine.optimizer, engine.lr_scheduler))


def unpackable(engine: Any) -> Any:
    """The engine itself (same object and attributes, still a ``DeepSpeedEngine``), whose class is
    swapped for a subclass adding only ``__iter__``, so OpenRLHF's ``m, o, s = prepare(...)``
    unpacks it. Neither ``nn.Module`` nor ``DeepSpeedEngine`` iterates, and without ``__len__``
    its truth value is unchanged.

    Args:
        engine: a training engine.

    Returns:
        ``engine``, unpackable.
    """
    cls = type(engine)
    if cls not in _UNPACKABLE.values():
        if cls not in _UNPACKABLE:
            _UNPACKABLE[cls] = type(cls.__name__, (cls,), {
                "__iter__": _engine_parts, "__slots__": (), "__doc__": cls.__doc__})
        engine.__class__ = _UNPACKABLE[cls]
    return engine


def check_training_engine(engine: Any, optimizer: Any = None, scheduler: Any = None) -> None:
    """``engine`` is a training engine, and ``optimizer``/``scheduler`` (OpenRLHF's arguments,
    which DeepSpeed steps through the engine) are its own.

    Args:
        engine: what was passed as the training engine.
        optimizer: OpenRLHF's optimizer argument (None: not given).
        scheduler: OpenRLHF's scheduler argument (None: not given).

    Raises:
        ConfigError: not a training engine, or another optimizer or scheduler than its own.
    """
    if not hasattr(engine, "is_gradient_accumulation_boundary"):
        fail("model", type(engine).__name__, "pass the training engine from "
             "strategy.prepare((model, optimizer, scheduler))")
    wrapped, owned = engine.optimizer, []
    while wrapped is not None and len(owned) < 4:  # a ZeRO/bf16 wrapper's .optimizer: the client's
        owned.append(wrapped)
        wrapped = getattr(wrapped, "optimizer", None)
    if optimizer is not None and not any(optimizer is o for o in owned):
        fail("optimizer", type(optimizer).__name__, "pass the optimizer prepare returned with "
             "this engine (or the one given to prepare): DeepSpeed steps that one")
    if scheduler is not None and scheduler is not engine.lr_scheduler:
        fail("scheduler", type(scheduler).__name__, "pass the scheduler given to prepare with "
             "this engine: DeepSpeed steps that one, at accumulation boundaries")


def check_sleep(config: Any, optimizer: str) -> None:
    """``--ds_enable_sleep`` with the optimizer it needs, before any process group: DeepSpeed
    moves ZeRO-3's states with FusedAdam only (``optimizer``: ``optim.optimizer``'s name)."""
    if config.ds_enable_sleep and config.zero_stage == 3 and not config.adam_offload \
            and optimizer != "fused_adam":
        fail("ds_enable_sleep", True, f"DeepSpeed moves ZeRO-3's states with FusedAdam only, "
             f"not {optimizer}: use --optimizer fused_adam, or --adam_offload (the states then "
             "live on CPU)")


def _sleeping_states() -> list[Any]:
    """What a sleeping engine moves off the device, as OpenRLHF's ``offload_deepspeed_states``:
    Adam's moments, the fp32 master weights, the gradient partitions and ZeRO-3's gradient
    buckets. The 16-bit weights stay: the rollout forwards with them."""
    return [State.optim_states, State.hp_params, State.lp_grads, State.contiguous_grad_buffer]


def is_asleep(engine: Any) -> bool:
    """Whether ``engine``'s training states are off the device (``sleep_engine``)."""
    return bool(getattr(engine.optimizer, "offloaded_states", None))


def sleep_engine(engine: Any) -> None:
    """Move ``engine``'s training states to CPU memory (DeepSpeed's ``offload_states``, pinned)
    until ``wake_engine``; nothing when they are there already."""
    if is_asleep(engine):
        return
    engine.optimizer.offload_states(include=_sleeping_states(), device=OffloadDeviceEnum.cpu,
                                    pin_memory=True, non_blocking=True)
    engine.empty_partition_cache()  # ZeRO-3's gathered weights too (frees the cache)
    get_accelerator().synchronize()


def wake_engine(engine: Any) -> None:
    """Bring ``engine``'s training states back to its device (DeepSpeed's ``reload_states``);
    nothing when they are there."""
    if is_asleep(engine):
        engine.reload_states(non_blocking=False)
