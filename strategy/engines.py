"""What the facade asks of a DeepSpeed engine beyond DeepSpeed's own API: that an engine (and the
optimizer and scheduler OpenRLHF's call forms pass beside it) is a training engine's, and the
engine that also unpacks as ``(engine, optimizer, scheduler)``, as OpenRLHF's ``prepare``
returns.

May import: ``errors``; nothing of ``strategy`` imports from here but the facade.
"""

from __future__ import annotations

from typing import Any

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
