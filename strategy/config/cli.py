"""YAML files and argparse flags bound to config dataclasses.

Flag names follow OpenRLHF (``--zero_stage --bf16 --micro_train_batch_size ...``).
Precedence: dataclass defaults < ``--config file.yaml`` < explicit CLI flags. A YAML key that is
no field fails with a suggestion; a value of the wrong type fails naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing
from typing import Any, Sequence

import yaml

from strategy.errors import ConfigError, fail

CONFIG_FLAG = "config"  # --config FILE.yaml


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _base_type(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def _convert(tp: Any, value: Any) -> Any:
    """``value`` as type ``tp``; raises TypeError/ValueError when it is not one."""
    if tp is bool and isinstance(value, bool):
        return value
    if tp in (int, float) and not isinstance(value, bool):
        out = tp(value)
        if tp is int and out != float(value):
            raise ValueError(value)
        return out
    if tp is str and isinstance(value, str):
        return value
    if typing.get_origin(tp) is tuple and len(value) == len(typing.get_args(tp)):
        return tuple(_convert(t, v) for t, v in zip(typing.get_args(tp), value))
    if tp is dict:
        value = json.loads(value) if isinstance(value, str) else value
        if isinstance(value, dict):
            return value
    raise TypeError(value)


def coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert a YAML/CLI value to the field's type, or fail naming the field."""
    tp = _base_type(tp)
    if value is None:
        return None
    try:
        return _convert(tp, value)
    except (TypeError, ValueError):
        fail(name, value, f"expected {getattr(tp, '__name__', tp)}")


def _flag_kwargs(field: dataclasses.Field, tp: Any) -> dict:
    base = _base_type(tp)
    kwargs: dict[str, Any] = {"default": None, "help": field.metadata.get("help", "")}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is tuple:
        kwargs.update(nargs=len(typing.get_args(base)), type=float)
    else:
        kwargs["type"] = json.loads if base is dict else base
    return kwargs


def add_config_args(parser: argparse.ArgumentParser, *classes: type) -> argparse.ArgumentParser:
    """Add ``--config``, ``--local_rank`` and one flag per field; defaults stay None so explicit
    flags can be told from unset ones.

    Args:
        parser: the parser to add to; adding the same classes twice is an argparse error.
        *classes: config dataclasses whose fields become flags (``--<field>``).

    Returns:
        ``parser``, for chaining.
    """
    try:
        parser.add_argument("--config", default=None,
                            help="YAML file of settings (CLI flags override it)")
        parser.add_argument("--local_rank", type=int, default=-1,
                            help="set by the deepspeed launcher")
    except argparse.ArgumentError:  # a parser that went through here before already has both
        pass
    for cls in classes:
        group = parser.add_argument_group(cls.__name__)
        for name, (field, tp) in _fields(cls).items():
            group.add_argument(f"--{name}", **_flag_kwargs(field, tp))
    return parser


def read_yaml(path: str) -> dict:
    """Read a YAML settings file.

    Args:
        path: the file's path.

    Returns:
        Its top-level mapping (empty for an empty file).

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping at the top level.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"config={path!r} is invalid: no such file; pass an existing YAML path")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(f"config={path!r} is invalid: not YAML ({first})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config={path!r} is invalid: top level must be a mapping of "
                          "setting: value")
    return data


def build_configs(classes: Sequence[type], values: dict, source: str = "config") -> list:
    """Split a flat mapping across the dataclasses (each validates itself on construction).

    Args:
        classes: the config dataclasses, in the order of the result.
        values: ``{field: value}`` for fields of any of them; values are coerced to field types.
        source: where the values came from, named in errors (e.g. the YAML path).

    Returns:
        One instance per class, in order.

    Raises:
        ConfigError: a key is no field (the message suggests a close one), or a value is invalid.
    """
    known = {name: cls for cls in classes for name in _fields(cls)}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "remove it"
            raise ConfigError(f"{source}: unknown key {key!r}; {hint}")
    return [cls(**{name: coerce(name, tp, values[name]) for name, (_, tp) in _fields(cls).items()
                   if name in values}) for cls in classes]


def parse_configs(classes: Sequence[type], argv: Sequence[str] | None = None,
                  parser: argparse.ArgumentParser | None = None) -> tuple[list, argparse.Namespace]:
    """Parse ``argv`` into instances of ``classes`` (defaults < YAML < flags), validated. The
    caller's own flags (added to ``parser`` beforehand) may also be set from the YAML file.

    Args:
        classes: the config dataclasses to build.
        argv: the command line without the program name; None reads ``sys.argv``.
        parser: a parser holding the caller's own flags; None starts an empty one. Flags are
            never abbreviated (``allow_abbrev`` is turned off).

    Returns:
        The config instances (in the order of ``classes``) and the parsed namespace.

    Raises:
        ConfigError: from ``read_yaml`` or ``build_configs``.
    """
    parser = parser or argparse.ArgumentParser()
    parser.allow_abbrev = False  # `--loss` must not silently become `--loss_weighting`
    namespace = add_config_args(parser, *classes).parse_args(argv)
    config_path = getattr(namespace, CONFIG_FLAG)
    values = read_yaml(config_path) if config_path else {}
    names = {name for cls in classes for name in _fields(cls)}
    own_flags = set(vars(namespace)) - names - {CONFIG_FLAG}
    for key in [k for k in values if k in own_flags]:
        value = values.pop(key)
        if getattr(namespace, key) == parser.get_default(key):
            setattr(namespace, key, value)
    values.update({k: v for k, v in vars(namespace).items() if k in names and v is not None})
    return build_configs(classes, values, config_path or "config"), namespace
