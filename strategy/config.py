"""Typed configs, validated in one place; YAML files and argparse flags bind to them.

Flag names follow OpenRLHF (``--zero_stage --bf16 --micro_train_batch_size ...``).
Precedence: dataclass defaults < ``--config file.yaml`` < explicit CLI flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml


class ConfigError(ValueError):
    """A bad setting: the message names the field, the value and the fix."""


def fail(name: str, value: Any, fix: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r} is invalid: {fix}")


def doc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field with a one-line help text (shown by ``--help``)."""
    if isinstance(default, (dict, list)):
        factory = (lambda d=default: type(d)(d))  # noqa: E731
        return field(default_factory=factory, metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)


@dataclass
class StrategyConfig:
    """Everything about ranks, ZeRO, offload and precision."""

    seed: int = doc("seed for Python, NumPy and torch on every rank", 42)
    zero_stage: int = doc("ZeRO stage: 0 (DDP), 1 (optimizer), 2 (+gradients), 3 (+parameters)", 2)
    bf16: bool = doc("train in bfloat16 with fp32 master weights", False)
    fp16: bool = doc("train in float16 with dynamic loss scaling", False)
    adam_offload: bool = doc("keep optimizer states on CPU and step with DeepSpeedCPUAdam (ZeRO >= 1)", False)
    offload_ratio: float = doc("share of optimizer states ZeRO-3 offloads (offload_optimizer.ratio; adam_offload)",
                               1.0)
    param_offload: bool = doc("keep parameters on CPU between uses (ZeRO-3 only)", False)
    micro_train_batch_size: int = doc("samples per rank per forward/backward", 8)
    train_batch_size: int = doc("global samples per optimizer step (micro x accumulation x world)", 128)
    micro_eval_batch_size: int = doc("samples per rank per eval forward", 8)
    max_norm: float = doc("gradient clipping norm; 0 disables clipping", 1.0)
    gradient_checkpointing: bool = doc("recompute activations in backward to save memory", False)
    zpg: int = doc("ZeRO++ hierarchical partition size (hpZ); 1 disables", 1)
    grad_accum_dtype: str | None = doc("dtype gradients accumulate in: fp32, bf16 or fp16 (default: DeepSpeed's)", None)
    overlap_comm: bool = doc("overlap gradient reduction with backward", False)
    timeout_minutes: float = doc("a collective waiting longer than this fails (a hung or lost rank)", 30.0)
    ds_config_overrides: dict = doc("dict deep-merged last into the DeepSpeed config", {})

    def validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", self.zero_stage, "use 0, 1, 2 or 3")
        if self.bf16 and self.fp16:
            fail("fp16", self.fp16, "bf16 and fp16 are exclusive; set only one of --bf16/--fp16")
        for name in ("micro_train_batch_size", "train_batch_size", "micro_eval_batch_size", "zpg"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "use a positive integer")
        if self.train_batch_size % self.micro_train_batch_size:
            fail("train_batch_size", self.train_batch_size,
                 f"must be a multiple of micro_train_batch_size={self.micro_train_batch_size}")
        if self.timeout_minutes <= 0:
            fail("timeout_minutes", self.timeout_minutes, "use a positive number of minutes, e.g. 30")
        if self.max_norm < 0:
            fail("max_norm", self.max_norm, "use 0 (no clipping) or a positive norm")
        if self.adam_offload and self.zero_stage == 0:
            fail("adam_offload", True, "optimizer offload needs ZeRO; set --zero_stage 1, 2 or 3")
        if not 0 < self.offload_ratio <= 1:
            fail("offload_ratio", self.offload_ratio, "use a fraction in (0, 1]; 1.0 offloads every optimizer state")
        if self.offload_ratio < 1 and (self.zero_stage != 3 or not self.adam_offload):
            fail("offload_ratio", self.offload_ratio, "partial offload runs only with ZeRO-3 and optimizer offload; "
                 "set --zero_stage 3 --adam_offload, or offload_ratio 1.0")
        if self.param_offload and self.zero_stage != 3:
            fail("param_offload", True, f"parameter offload needs ZeRO-3, got zero_stage={self.zero_stage}")
        if self.grad_accum_dtype not in (None, "fp32", "bf16", "fp16"):
            fail("grad_accum_dtype", self.grad_accum_dtype, "use fp32, bf16 or fp16")
        if not isinstance(self.ds_config_overrides, dict):
            fail("ds_config_overrides", self.ds_config_overrides, "use a mapping, e.g. {steps_per_print: 10}")
        from strategy.ds_config import check_overrides

        check_overrides(self.ds_config_overrides)

    def validate_world(self, world_size: int) -> None:
        """Checks that need the number of ranks (known from the launcher's env before init)."""
        per_step = self.micro_train_batch_size * world_size
        if self.train_batch_size % per_step:
            fail("train_batch_size", self.train_batch_size,
                 f"must be a multiple of micro_train_batch_size x world_size = "
                 f"{self.micro_train_batch_size} x {world_size} = {per_step}")

    def accumulation_steps(self, world_size: int) -> int:
        return self.train_batch_size // (self.micro_train_batch_size * world_size)


OPTIMIZERS = ("fused_adam", "cpu_adam", "hybrid_adam")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    learning_rate: float = doc("peak learning rate", 1e-5)
    lr_scheduler: str = doc("schedule name: cosine_with_min_lr or any transformers scheduler", "cosine_with_min_lr")
    lr_warmup_ratio: float = doc("fraction of training steps spent warming up linearly", 0.03)
    min_lr_ratio: float = doc("final lr as a fraction of the peak (cosine_with_min_lr)", 0.1)
    l2: float = doc("decoupled weight decay (not applied to biases and norm weights)", 0.0)
    adam_betas: tuple[float, float] = doc("Adam beta1 beta2", (0.9, 0.95))
    adam_eps: float = doc("Adam epsilon", 1e-8)
    optimizer: str = doc("fused_adam (DeepSpeedCPUAdam with adam_offload), cpu_adam (DeepSpeedCPUAdam) or hybrid_adam",
                         "fused_adam")

    def validate(self) -> None:
        if self.learning_rate <= 0:
            fail("learning_rate", self.learning_rate, "use a positive learning rate, e.g. 1e-5")
        if not 0 <= self.lr_warmup_ratio <= 1:
            fail("lr_warmup_ratio", self.lr_warmup_ratio, "use a fraction in [0, 1]")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("min_lr_ratio", self.min_lr_ratio, "use a fraction in [0, 1]")
        if self.l2 < 0:
            fail("l2", self.l2, "use a weight decay >= 0")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            fail("adam_betas", self.adam_betas, "use two values in [0, 1), e.g. 0.9 0.95")
        if self.adam_eps <= 0:
            fail("adam_eps", self.adam_eps, "use a small positive epsilon, e.g. 1e-8")
        if self.optimizer not in OPTIMIZERS:
            fail("optimizer", self.optimizer, f"use one of {', '.join(OPTIMIZERS)}")
        from transformers.trainer_utils import SchedulerType

        names = {s.value for s in SchedulerType} | {"cosine_annealing_warmup"}
        if self.lr_scheduler not in names:
            fail("lr_scheduler", self.lr_scheduler, f"use one of {sorted(names)}")


# ---------------------------------------------------------------- binding


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return tp


def coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert a YAML/CLI value to the field's type, or fail naming the field."""
    tp = _base_type(tp)
    if value is None:
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if tp in (int, float):
            if isinstance(value, bool):
                raise TypeError
            out = tp(value)
            if tp is int and out != float(value):
                raise TypeError
            return out
        if tp is str:
            if not isinstance(value, str):
                raise TypeError
            return value
        if typing.get_origin(tp) is tuple:
            inner = typing.get_args(tp)
            if len(value) != len(inner):
                raise TypeError
            return tuple(coerce(name, t, v) for t, v in zip(inner, value))
        if tp is dict:
            value = json.loads(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise TypeError
            return value
    except (TypeError, ValueError):
        pass
    else:
        return value
    fail(name, value, f"expected {getattr(tp, '__name__', tp)}")


def add_config_args(parser: argparse.ArgumentParser, *classes: type) -> argparse.ArgumentParser:
    """Add one flag per field; defaults stay None so explicit flags can be told from unset ones."""
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", default=None, help="YAML file of settings (CLI flags override it)")
        parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    for cls in classes:
        group = parser.add_argument_group(cls.__name__)
        for name, (f, tp) in _fields(cls).items():
            base, kw = _base_type(tp), {"default": None, "help": f.metadata.get("help", "")}
            if base is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(base) is tuple:
                kw.update(nargs=len(typing.get_args(base)), type=float)
            elif base is dict:
                kw["type"] = json.loads
            else:
                kw["type"] = base
            group.add_argument(f"--{name}", **kw)
    return parser


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config={path!r} is invalid: no such file; pass an existing YAML path")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config={path!r} is invalid: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config={path!r} is invalid: top level must be a mapping of setting: value")
    return data


def build_configs(classes: Sequence[type], values: dict, source: str = "config") -> list:
    """Split a flat mapping across the dataclasses; unknown keys fail with a suggestion."""
    known = {name: cls for cls in classes for name in _fields(cls)}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "remove it"
            raise ConfigError(f"{source}: unknown key {key!r}; {hint}")
    out = []
    for cls in classes:
        kwargs = {n: coerce(n, tp, values[n]) for n, (f, tp) in _fields(cls).items() if n in values}
        obj = cls(**kwargs)
        obj.validate()
        out.append(obj)
    return out


def parse_configs(classes: Sequence[type], argv: Sequence[str] | None = None,
                  parser: argparse.ArgumentParser | None = None) -> tuple[list, argparse.Namespace]:
    """Parse ``argv`` into instances of ``classes`` (defaults < YAML < flags), validated."""
    parser = add_config_args(parser or argparse.ArgumentParser(), *classes)
    ns = parser.parse_args(argv)
    values = read_yaml(ns.config) if ns.config else {}
    source = ns.config or "config"
    names = {n for cls in classes for n in _fields(cls)}
    extra = {a.dest for a in parser._actions} - names - {"help", "config"}
    for key in list(values):  # YAML may also set the caller's own (non-dataclass) flags
        if key in extra:
            value = values.pop(key)
            if getattr(ns, key) == parser.get_default(key):
                setattr(ns, key, value)
    values.update({k: v for k, v in vars(ns).items() if k in names and v is not None})
    return build_configs(classes, values, source), ns
