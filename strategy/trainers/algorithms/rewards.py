"""Rewards for online RL: a Python callable named ``module:function``, or a reward model.

A callable is found (imported, checked callable) before any process group starts and is then
called as ``f(prompt, completion, row) -> float`` for each completion; the first value that is
not a finite number stops every rank with a line naming the prompt. A reward model
(``AutoModelForSequenceClassification``, one label, as ``RewardModelTrainer`` trains) runs as an
eval engine and scores prompt + completion at its last token, re-tokenized with its own tokenizer.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Callable

import torch

from strategy.errors import DataError, fail


def load_reward_fn(spec: str) -> Callable[[str, str, dict], float]:
    """``module:function`` (a dotted module path importable here) as the callable it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        fail("reward_fn", spec, "write it as module:function, e.g. "
             "strategy.demos.toy_task:reversal_reward")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fail("reward_fn", spec, f"cannot import {module_name!r} ({exc}); put it on PYTHONPATH")
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        fail("reward_fn", spec, f"{module_name} has no callable {attr!r}")
    return fn


def checked_reward(value: Any, prompt: str, spec: str) -> float:
    """A reward as a float; anything else is a one-line error naming the prompt."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DataError(f"reward_fn={spec!r} returned {value!r} ({type(value).__name__}) for "
                        f"prompt {prompt[:80]!r}; return a finite float")
    return float(value)


class CallableReward:
    """``f(prompt, completion, row)`` over a rollout's completions."""

    def __init__(self, spec: str) -> None:
        self.spec, self.fn = spec, load_reward_fn(spec)

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        return [checked_reward(self.fn(p, c, r), p, self.spec)
                for p, c, r in zip(prompts, completions, rows)]


class ModelReward:
    """A reward model's score of each prompt + completion (an eval engine; same number of
    forwards on every rank: one per call)."""

    def __init__(self, engine, tokenizer, max_len: int) -> None:
        self.engine, self.tokenizer, self.max_len = engine, tokenizer, max_len

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions)]
        self.tokenizer.padding_side = "right"
        encoded = self.tokenizer(texts, add_special_tokens=False, padding=True, truncation=True,
                                 max_length=self.max_len, return_tensors="pt")
        device = self.engine.device
        logits = self.engine(input_ids=encoded["input_ids"].to(device),
                             attention_mask=encoded["attention_mask"].to(device)).logits
        return [float(score) for score in logits[:, 0].float().cpu()]
