"""OpenRLHF 0.11's flag spellings (``--ds.zero_stage 3``, ``--optim adam``, ``--target_modules
q_proj v_proj``, ``--use_wandb TOKEN``) in ours, before parsing: the tables of ``openrlhf_flags``
say what each becomes, or why it is refused. Every OpenRLHF translation is here or there."""

from __future__ import annotations

import os
import sys

from strategy.cli.openrlhf_flags import (
    DEVICE_FLAGS,
    DOTTED,
    PARSERS,
    PER_PARSER,
    REFUSED,
    VALUE_MAPS,
)
from strategy.errors import ConfigError

# our command -> the OpenRLHF parser whose flags it takes
PARSER_OF = {"sft": "train_sft", "rm": "train_rm", "dpo": "train_dpo", "orpo": "train_dpo",
             "simpo": "train_dpo", "kto": "train_dpo", "grpo": "train_ppo_ray",
             "ppo": "train_ppo_ray"}


def dotted_argv(argv: list[str], command: str | None = None) -> list[str]:
    """``argv`` with each OpenRLHF flag replaced by our tokens (``DOTTED``, and
    ``PER_PARSER`` of ``command``'s OpenRLHF parser first); our own flags pass unchanged.

    Args:
        argv: the command line without the program name.
        command: our trainer command (``sft``...), for the flags whose meaning depends on it.

    Returns:
        The translated command line.

    Raises:
        ConfigError: an OpenRLHF flag with no setting here (``REFUSED``: one line naming ours),
            or a value it has no equivalent of.
    """
    table = {**DOTTED, **PER_PARSER.get(PARSER_OF.get(command, ""), {})}
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        name, eq, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in REFUSED:
            raise ConfigError(f"--{name} (OpenRLHF's) is not supported here: {REFUSED[name]}")
        if name in DEVICE_FLAGS:  # taken when it names what this machine's device uses
            _check_device_flag(name, inline if eq else (rest.pop(0) if rest else ""))
            continue
        if name not in table:
            out.append(arg)  # ours, or unknown: the parser refuses it with a close match
            continue
        out.extend(_translate(name, table[name], [inline] if eq else [], rest))
    return out


def openrlhf_argv(argv: list[str]) -> list[str]:
    """OpenRLHF's multi-value spellings as ours: ``--target_modules q_proj v_proj`` becomes
    ``--target_modules q_proj,v_proj``; ``--use_wandb TOKEN`` as in ``wandb_key_taken``."""
    out: list[str] = []
    for arg in wandb_key_taken(argv):
        if len(out) >= 2 and out[-2] == "--target_modules" and not arg.startswith("-"):
            out[-1] = f"{out[-1]},{arg}"
        else:
            out.append(arg)
    return out


def wandb_key_taken(argv: list[str]) -> list[str]:
    """OpenRLHF's ``--use_wandb TOKEN`` (or ``--use_wandb True``): the token becomes
    ``WANDB_API_KEY`` (what ``wandb.login`` reads) and the flag our plain ``--use_wandb``."""
    out = []
    for arg in argv:
        if out and out[-1] == "--use_wandb" and not arg.startswith("-"):
            if arg.lower() not in ("true", "1"):
                os.environ["WANDB_API_KEY"] = arg
            continue
        if arg.startswith("--use_wandb="):
            out.extend(wandb_key_taken(["--use_wandb", arg.partition("=")[2]]))
            continue
        out.append(arg)
    return out


def _translate(name: str, template: tuple[str, ...], values: list[str],
               rest: list[str]) -> list[str]:
    """``template``'s tokens, each ``{}`` filled by the flag's next value (taken from
    ``rest``); further values of a list flag follow (``--target_modules q_proj v_proj``)."""
    wanted = sum(token == "{}" for token in template)
    while rest and not rest[0].startswith("--") and (len(values) < wanted or wanted):
        values.append(rest.pop(0))
    if len(values) < wanted:
        raise ConfigError(f"--{name} (OpenRLHF's) is invalid: it takes {wanted} value(s), got "
                          f"{len(values)}")
    mapping = VALUE_MAPS.get(name)
    if mapping is not None:
        if any(value not in mapping for value in values):
            bad = next(value for value in values if value not in mapping)
            raise ConfigError(f"--{name} {bad} (OpenRLHF's) has no equivalent here; use one of "
                              f"{', '.join(mapping)}")
        values = [mapping[value] for value in values]
    filled = [values.pop(0) if token == "{}" else token for token in template]
    return filled + values


def _check_device_flag(name: str, value: str) -> None:
    """A value ``DEVICE_FLAGS`` takes on this machine's device (CUDA or CPU), or one line."""
    import torch  # deferred: only when such a flag is given

    device = "cuda" if torch.cuda.is_available() else "cpu"
    taken = DEVICE_FLAGS[name][device]
    if value not in taken:
        raise ConfigError(f"--{name} {value} (OpenRLHF's) is invalid on this machine: its "
                          f"{device.upper()} device uses {taken[0]} here; pass {taken[0]} or "
                          "drop it")


def markdown_table() -> str:
    """Every flag of OpenRLHF 0.11's four parsers and what it becomes here, as the Markdown table
    of ``docs/commands.md`` (``python -m strategy.cli.dotted`` prints it; a test compares).

    Returns:
        The table.
    """
    rows = ["| OpenRLHF 0.11 flag | its parsers | here |", "|---|---|---|"]
    names = sorted({flag for flags in PARSERS.values() for flag in flags})
    for flag in names:
        parsers = ", ".join(p.removeprefix("train_") for p, fl in PARSERS.items() if flag in fl)
        per = [f"{p.removeprefix('train_')}: {_shown(t[flag])}" for p, t in PER_PARSER.items()
               if flag in t]
        if flag in REFUSED:
            here = f"refused: {REFUSED[flag]}"
        elif flag in DEVICE_FLAGS:
            here = "the device's: " + "; ".join(
                f"{' or '.join(values)} on {device.upper()} ({values[0]} runs)"
                for device, values in DEVICE_FLAGS[flag].items()) + " (another: one line)"
        else:
            here = "; ".join([_shown(DOTTED[flag]) + _mapped(flag), *per])
        rows.append(f"| `--{flag}` | {parsers} | {here.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


def _shown(template: tuple[str, ...]) -> str:
    return f"`{' '.join('X' if t == '{}' else t for t in template)}`" if template else (
        "always so here (nothing to pass)")


def _mapped(flag: str) -> str:
    pairs = VALUE_MAPS.get(flag)
    return "" if not pairs else " (" + ", ".join(f"{a} -> {b}" for a, b in pairs.items()) + ")"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
