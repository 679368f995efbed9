"""Checks on ``ds_config_overrides``: keys DeepSpeed would silently ignore, or reject only late,
deep inside ``deepspeed.initialize``."""

from __future__ import annotations

import difflib

from strategy.errors import ConfigError
from strategy.internals import deepspeed_config_keys, zero_config_error


def check_overrides(overrides: dict) -> None:
    """Refuse unknown top-level keys and a ZeRO section DeepSpeed's schema rejects."""
    known = deepspeed_config_keys()
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see DeepSpeed's config reference"
            raise ConfigError(f"ds_config_overrides has unknown key {key!r} that DeepSpeed would "
                              f"ignore; {hint}")
    zero = overrides.get("zero_optimization")
    if isinstance(zero, dict):
        problem = zero_config_error(zero)
        if problem is not None:
            raise ConfigError(f"ds_config_overrides.zero_optimization.{problem[0]} is invalid: "
                              f"{problem[1]}")
