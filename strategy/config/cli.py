"""YAML files and argparse flags bound to config dataclasses.

Flag names follow OpenRLHF (``--zero_stage --bf16 --micro_train_batch_size ...``).
Precedence: dataclass defaults < ``--config file.yaml`` < explicit CLI flags. A YAML key that is
no field fails with a suggestion; a value of the wrong type fails naming the field. An optional
setting (``X | None``) set by a YAML file is unset from the command line with ``--flag none``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from strategy.errors import ConfigError, fail

CONFIG_FLAG = "config"  # --config FILE.yaml
PRINT_FLAG = "print_config"  # --print_config: the checked settings as YAML, then exit 0
NOT_SETTINGS = (CONFIG_FLAG, PRINT_FLAG, "local_rank")  # flags that are no setting
NONE_WORDS = ("none", "null")  # an optional flag's value that unsets it (YAML's null)


class _Cleared:
    """What ``--flag none`` parses to, told from an unset flag's None."""

    def __repr__(self) -> str:
        return "none"


CLEARED = _Cleared()
SHIPPED = Path(__file__).resolve().parents[1] / "configs"  # configs/, package data of the wheel


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


def _optional(tp: Any) -> bool:
    """Whether the field's type is ``X | None``."""
    return _base_type(tp) is not tp


def _or_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag's ``type``, taking ``none`` (or ``null``) for None as well."""
    def parse(text: str) -> Any:
        return CLEARED if text.lower() in NONE_WORDS else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in errors
    return parse


def _flag_kwargs(field: dataclasses.Field, tp: Any) -> dict:
    base = _base_type(tp)
    kwargs: dict[str, Any] = {"default": None, "help": field.metadata.get("help", "")}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is tuple:
        kwargs.update(nargs=len(typing.get_args(base)), type=float)
    else:
        convert = json.loads if base is dict else base
        kwargs["type"] = _or_none(convert) if _optional(tp) else convert
        if _optional(tp):
            kwargs["help"] += " (none: unset it)"
    return kwargs


def add_config_args(parser: argparse.ArgumentParser, *classes: type,
                    hidden: frozenset = frozenset()) -> argparse.ArgumentParser:
    """Add ``--config``, ``--local_rank`` and one flag per field; defaults stay None so explicit
    flags can be told from unset ones.

    Args:
        parser: the parser to add to; adding the same classes twice is an argparse error.
        *classes: config dataclasses whose fields become flags (``--<field>``).
        hidden: fields that get no flag (another trainer's; they keep their defaults).

    Returns:
        ``parser``, for chaining.
    """
    try:
        parser.add_argument("--config", default=None,
                            help="YAML file of settings (CLI flags override it)")
        parser.add_argument("--local_rank", type=int, default=-1,
                            help="set by the deepspeed launcher")
        parser.add_argument(f"--{PRINT_FLAG}", action="store_true",
                            help="check every setting as a run would, print them as YAML that "
                                 "--config loads back, and exit 0 (no model, no rank)")
    except argparse.ArgumentError:  # a parser that went through here before already has both
        pass
    for cls in classes:
        group = parser.add_argument_group(cls.__name__)
        for name, (field, tp) in _fields(cls).items():
            if name not in hidden:
                group.add_argument(f"--{name}", **_flag_kwargs(field, tp))
    return parser


def shipped_configs() -> dict[str, str]:
    """The YAML configs shipped with the package (``configs/`` of the repository, package data
    of the wheel), by name without ``.yaml``.

    Returns:
        ``{name: path}``.
    """
    return {p.stem: str(p) for p in sorted(SHIPPED.glob("*.yaml"))} if SHIPPED.is_dir() else {}


def shipped_file(path: str) -> str:
    """``path`` if it exists, else the shipped file of its name (a shipped config's
    ``model_config: configs/tiny_llama.json`` from any directory), else ``path`` unchanged.

    Args:
        path: a file a setting names.

    Returns:
        The path to read.
    """
    shipped = SHIPPED / os.path.basename(path)
    return path if os.path.exists(path) or not shipped.is_file() else str(shipped)


def config_path(value: str) -> str:
    """``--config``'s file: a path as given, else a shipped config by name (``sft_zero2`` or
    ``sft_zero2.yaml``).

    Args:
        value: what ``--config`` was given.

    Returns:
        The path to read.

    Raises:
        ConfigError: neither an existing file nor a shipped config's name.
    """
    if os.path.isfile(value):
        return value
    shipped = shipped_configs()
    name = value[:-len(".yaml")] if value.endswith(".yaml") else value
    if os.sep not in value and name in shipped:
        return shipped[name]
    close = difflib.get_close_matches(name, shipped, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"config={value!r} is invalid: no such file or shipped config; {hint}pass "
                      f"a YAML path or one of {', '.join(shipped) or 'the shipped configs'}")


def read_yaml(path: str) -> dict:
    """Read a YAML settings file.

    Args:
        path: the file's path, or a shipped config's name (``config_path``).

    Returns:
        Its top-level mapping (empty for an empty file).

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping at the top level.
    """
    path = config_path(path)
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


def build_configs(classes: Sequence[type], values: dict, source: str = "config",
                  foreign: dict[str, str] | None = None) -> list:
    """Split a flat mapping across the dataclasses (each validates itself on construction).

    Args:
        classes: the config dataclasses, in the order of the result.
        values: ``{field: value}`` for fields of any of them; values are coerced to field types.
        source: where the values came from, named in errors (e.g. the YAML path).
        foreign: ``{key: refusal}`` for another trainer's settings (the line to raise).

    Returns:
        One instance per class, in order.

    Raises:
        ConfigError: a key is no field (the message suggests a close one, or names the trainers
            that take it), or a value is invalid.
    """
    known = {name: cls for cls in classes for name in _fields(cls)}
    for key in values:
        if key in (foreign or {}):
            raise ConfigError(f"{source}: {foreign[key]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "remove it"
            raise ConfigError(f"{source}: unknown key {key!r}; {hint}")
    for cls in classes:
        required = [name for name, (field, _) in _fields(cls).items() if name not in values
                    and field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING]
        if required:
            raise ConfigError(f"{required[0]} is required: pass --{required[0]} VALUE (or set "
                              f"it in --config)")
    return [cls(**{name: coerce(name, tp, values[name]) for name, (_, tp) in _fields(cls).items()
                   if name in values}) for cls in classes]


def parse_configs(classes: Sequence[type], argv: Sequence[str] | None = None,
                  parser: argparse.ArgumentParser | None = None,
                  foreign: dict[str, str] | None = None,
                  hidden: frozenset = frozenset()) -> tuple[list, argparse.Namespace]:
    """Parse ``argv`` into instances of ``classes`` (defaults < YAML < flags), validated. The
    caller's own flags (added to ``parser`` beforehand) may also be set from the YAML file.

    Args:
        classes: the config dataclasses to build.
        argv: the command line without the program name; None reads ``sys.argv``.
        parser: a parser holding the caller's own flags; None starts an empty one. Flags are
            never abbreviated (``allow_abbrev`` is turned off).
        foreign: ``{flag name: refusal line}`` for flags of other trainers.
        hidden: fields that take no flag nor YAML key (``add_config_args``); each should have
            its line in ``foreign``.

    Returns:
        The config instances (in the order of ``classes``) and the parsed namespace.

    Raises:
        ConfigError: an unknown flag or key (one line: the trainers that take it, or a close
            match), a flag's value of the wrong form, or from ``read_yaml``/``build_configs``.
    """
    parser = parser or argparse.ArgumentParser()
    parser.allow_abbrev = False  # `--loss` must not silently become `--loss_weighting`
    parser.error = _raise_config_error  # one line, no usage block
    namespace, unknown = add_config_args(parser, *classes, hidden=hidden).parse_known_args(argv)
    if unknown:
        raise ConfigError(_unknown_flag(unknown, parser, foreign or {}))
    config_path = getattr(namespace, CONFIG_FLAG)
    values = read_yaml(config_path) if config_path else {}
    names = {name for cls in classes for name in _fields(cls)} - hidden
    own_flags = set(vars(namespace)) - names - set(NOT_SETTINGS)
    for key in [k for k in values if k in own_flags]:
        value = values.pop(key)
        if getattr(namespace, key) == parser.get_default(key):
            setattr(namespace, key, value)
    for key in [k for k, v in vars(namespace).items() if v is CLEARED]:
        values[key] = None  # `--flag none`: unset, over the YAML's value
        setattr(namespace, key, None)
    values.update({k: v for k, v in vars(namespace).items() if k in names and v is not None})
    return build_configs(classes, values, config_path or "config", foreign), namespace


def settings_yaml(configs: Sequence, namespace: argparse.Namespace,
                  hidden: frozenset = frozenset()) -> str:
    """The resolved settings as a YAML file that ``--config`` loads back to the same settings:
    each config's fields (but ``hidden``) under a comment naming its class, then the script's
    own flags.

    Args:
        configs: the config instances, in the order to print them.
        namespace: the parsed flags (a script's own flags are printed from it).
        hidden: fields that take no flag nor key (another trainer's).

    Returns:
        The YAML text.
    """
    def section(title: str, values: dict) -> str:
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        return f"# {title}\n" + yaml.safe_dump(plain, sort_keys=False, default_flow_style=False,
                                               width=1000)

    parts, names = [], set()
    for config in configs:
        fields = _fields(type(config))
        names.update(fields)
        parts.append(section(type(config).__name__, {
            name: getattr(config, name) for name in fields if name not in hidden}))
    own = {k: v for k, v in vars(namespace).items() if k not in names and k not in NOT_SETTINGS}
    if own:
        parts.append(section("the script's own flags", own))
    return "\n".join(parts)


def print_settings_and_exit(configs: Sequence, namespace: argparse.Namespace,
                            hidden: frozenset = frozenset()) -> None:
    """``--print_config``: ``settings_yaml`` on stdout (rank 0's alone), then exit 0 on every
    rank alike.

    Args:
        configs: the checked config instances, in the order to print them.
        namespace: the parsed flags.
        hidden: fields that take no flag nor key (another trainer's).

    Raises:
        SystemExit: always, with status 0.
    """
    if os.environ.get("RANK", "0") == "0":
        print(settings_yaml(configs, namespace, hidden), end="", flush=True)
    raise SystemExit(0)


def _raise_config_error(message: str):
    raise ConfigError(f"bad command line: {message}")


def _unknown_flag(unknown: list[str], parser: argparse.ArgumentParser,
                  foreign: dict[str, str]) -> str:
    """The line refusing the first argument no flag of ``parser`` takes."""
    flags = [arg for arg in unknown if arg.startswith("--")]
    if not flags:
        return f"unexpected argument {unknown[0]!r}: every setting is a --flag VALUE pair"
    name = flags[0][2:].partition("=")[0]
    if name in foreign:
        return foreign[name]
    ours = [opt[2:] for opt in parser._option_string_actions if opt.startswith("--")]
    close = difflib.get_close_matches(name, ours, n=1)
    hint = f"did you mean --{close[0]}?" if close else "see --help for the flags"
    return f"--{name} is not a flag here; {hint}"
