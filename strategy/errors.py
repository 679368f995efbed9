"""The errors this package raises: one base class, each specific error also the builtin it replaces.

``except StrategyError`` catches anything we raise on purpose; ``except ValueError`` (or
``OSError``, ``RuntimeError``...) still catches what it caught before these classes existed. Every
message is one line that names the field, file or rank and says what to do.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

# bitsandbytes, imported by peft and transformers in every run, warns at import on AVX512-BF16
# CPUs that an optional kernel package is missing: a line above everything a run prints, its
# one-line errors too. It matters to 4-bit runs alone, where ``strategy.quant`` says it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _not_cpu_fallback(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Setting accelerator to CPU.")


# DeepSpeed, on a machine without CUDA, logs on stdout at import that it falls back to its CPU
# accelerator ("If you have GPU or other accelerator, we were unable to detect it"): a line above
# every run's output and inside what --print_config writes; the run's settings say the device
logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback)


class StrategyError(Exception):
    """Base of every error raised on purpose by ``strategy``."""


class ConfigError(StrategyError, ValueError):
    """A bad setting: the message names the field, the value and the fix."""


class DataError(StrategyError, ValueError):
    """A bad data file or row: the message names the file, the row and the fix."""


class CorruptWeightsError(StrategyError, ValueError):
    """A weights file that cannot be what its header or index says: the message names the file."""


class CheckpointFileError(StrategyError, RuntimeError):
    """A checkpoint file that is missing, damaged or holds objects we refuse to unpickle."""


class SaveError(StrategyError, RuntimeError):
    """A save (checkpoint or export) failed on some rank; earlier saves are intact."""


class RankFailedError(StrategyError, RuntimeError):
    """Another rank failed; raised on every rank with the first failure's message."""


class NonFiniteLossError(StrategyError, FloatingPointError):
    """The training loss became NaN or infinite (outside fp16's loss-scaler skips)."""


def fail(name: str, value: Any, fix: str) -> NoReturn:
    """Raise the one-line ``ConfigError`` shape: ``name=value is invalid: fix``.

    Args:
        name: the setting's name.
        value: its bad value (shown with ``repr``).
        fix: what to do instead.

    Raises:
        ConfigError: always.
    """
    raise ConfigError(f"{name}={value!r} is invalid: {fix}")
