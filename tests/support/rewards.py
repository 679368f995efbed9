"""Reward functions for the reward tests: standard library only, so a ``--reward_timeout`` worker
imports them at once."""

from __future__ import annotations

import os
import time


def length_reward(prompt: str, completion: str, row: dict) -> float:
    return float(len(completion))


def match_reward(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    return [float(c == r["answer"]) for c, r in zip(completions, rows)]


match_reward.batched = True


def short_batch(prompts, completions, rows):
    return [1.0]


short_batch.batched = True


def raising_reward(prompt: str, completion: str, row: dict) -> float:
    if prompt == "p2":
        raise KeyError("answer")
    return 0.0


def hanging_reward(prompt: str, completion: str, row: dict) -> float:
    if prompt == "p2":
        time.sleep(120)
    return 1.0


def hanging_on_rank_1(prompt: str, completion: str, row: dict) -> float:
    """For the 2-rank test: hangs on rank 1 only (the worker inherits the rank's environment)."""
    if os.environ.get("RANK") == "1":
        time.sleep(120)
    return 1.0


def uniform_or_parity(prompt: str, completion: str, row: dict) -> float:
    """Two prompts in three get one score whatever the completion (1.0 or 0.0: a group with no
    signal, which dynamic sampling drops); the third the completion length's parity."""
    kind = len(row["input"]) % 3
    return 1.0 if kind == 0 else 0.0 if kind == 1 else float(len(completion) % 2)
