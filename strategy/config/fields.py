"""Helpers every config dataclass uses: a field with its one-line help, and common checks."""

from __future__ import annotations

import dataclasses
from typing import Any

from strategy.errors import fail


def doc(text: str, default: Any = dataclasses.MISSING, trainers: tuple[str, ...] | None = None,
        **kw: Any) -> Any:
    """A dataclass field with a one-line help text (shown by ``--help``).

    Args:
        text: the help text, one line.
        default: the default; a dict or list is copied for each instance.
        trainers: the trainer commands whose flag this shared field is (``("dpo", "kto")``);
            the others neither show nor take it (None: every trainer's).
        **kw: more ``dataclasses.field`` arguments.

    Returns:
        The ``dataclasses.field`` to assign to the class attribute.
    """
    metadata = {"help": text, "trainers": trainers}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


def check_positive(config: Any, *names: str) -> None:
    """Each named integer field is at least 1."""
    for name in names:
        if getattr(config, name) < 1:
            fail(name, getattr(config, name), "use a positive integer")


def check_steps(config: Any, *names: str, unit: str = "steps") -> None:
    """Each named field is a positive number of ``unit`` (steps, rollouts), or -1 (off)."""
    for name in names:
        value = getattr(config, name)
        if value == 0 or value < -1:
            fail(name, value, f"use a positive number of {unit}, or -1")


def check_fraction(config: Any, name: str, low: float = 0.0, high: float = 1.0) -> None:
    value = getattr(config, name)
    if not low <= value <= high:
        fail(name, value, f"use a value in [{low}, {high}]")
