"""Rewards for online RL: a Python callable named ``module:function``, or a reward model.

A callable is found (imported, checked callable) before any process group starts and is then
called as ``f(prompt, completion, row) -> float`` for each completion; the first value that is
not a finite number stops every rank with a line naming the prompt. A reward model
(``AutoModelForSequenceClassification``, one label, as ``RewardModelTrainer`` trains) runs as an
eval engine and scores prompt + completion re-tokenized with its own tokenizer exactly as its
training data was (prompt and response tokenized apart, the response closed by its EOS when the
completion ended), at that EOS: the position ``RewardModelTrainer`` trained it on.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Callable

import torch

from strategy.errors import DataError, fail
from strategy.trainers.losses import sequence_scores


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
    forwards on every rank: one per call). ``scores_eos``: GRPO tells it which completions ended
    with the policy's EOS, and those are scored at the reward model's own EOS."""

    scores_eos = True

    def __init__(self, engine, tokenizer, max_len: int) -> None:
        self.engine, self.tokenizer, self.max_len = engine, tokenizer, max_len

    def token_ids(self, prompt: str, completion: str, ended: bool) -> list[int]:
        """The ids the reward model trained on for this pair, their end kept under ``max_len``."""
        encode = self.tokenizer
        ids = encode(prompt, add_special_tokens=False)["input_ids"]
        ids = ids + encode(completion, add_special_tokens=False)["input_ids"]
        return (ids + [self.tokenizer.eos_token_id] * ended)[-self.max_len:]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict],
                 ended: list[bool] | None = None) -> list[float]:
        ended = ended if ended is not None else [False] * len(prompts)
        ids = [self.token_ids(p, c, e) for p, c, e in zip(prompts, completions, ended)]
        width = max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        device = self.engine.device
        batch = {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids],
                                           device=device),
                 "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x))
                                                 for x in ids], device=device)}
        return [float(score) for score in sequence_scores(self.engine.module, batch).cpu()]
