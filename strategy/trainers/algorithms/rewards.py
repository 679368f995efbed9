"""Rewards for online RL: Python callables named ``module:function``, a reward model, or a weighted
sum of several (``Rewards``).

A callable is found (imported, checked callable) before any process group starts and is then
called as ``f(prompt, completion, row) -> float`` for each completion, or, when the function has
``batched = True``, once per rollout as ``f(prompts, completions, rows) -> list of floats``. The
first value that is not a finite number, or an exception from the function, stops every rank
with a line naming the function and the prompt. With ``--reward_timeout S`` each function runs in
a worker process of the rank (``reward_worker.py``: a new interpreter importing only the function's
module; samples and scores travel as JSON lines): a call that does not return within S seconds
(per sample; per batch for a batched function) has its worker killed and stops every rank with a
line naming the function and the prompt.

A reward model (``AutoModelForSequenceClassification``, one label, as ``RewardModelTrainer``
trains) runs as an eval engine and scores prompt + completion re-tokenized with its own tokenizer
exactly as its training data was (prompt and response tokenized apart, the response closed by its
EOS when the completion ended), at that EOS: the position ``RewardModelTrainer`` trained it on.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any, Callable

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from strategy.errors import DataError, fail
from strategy.model import saved_reward_scale
from strategy.rollout.remote_models import remote_group
from strategy.trainers.algorithms.remote_reward import OpenRLHFReward, finite_number
from strategy.trainers.losses import sequence_scores

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
WORKER_START_S = 300  # importing the reward's module (and whatever it imports) in the worker


def load_reward_fn(spec: str) -> Callable[..., Any]:
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
    number = finite_number(value)
    if number is None:
        value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        raise DataError(f"reward_fn={spec!r} returned {value!r} ({type(value).__name__}) for "
                        f"prompt {prompt[:80]!r}; return a finite float")
    return number


def _calls(fn: Callable, batched: bool, prompts: list[str], completions: list[str],
           rows: list[dict]):
    """(index of the first sample, its scores) per call: one call per sample, or one in all."""
    if batched:
        yield 0, list(fn(prompts, completions, rows))
        return
    for i, args in enumerate(zip(prompts, completions, rows)):
        yield i, [fn(*args)]


class CallableReward:
    """A ``module:function`` reward over a rollout's completions (per sample, or batched), in a
    worker process with a time limit when ``timeout`` > 0."""

    def __init__(self, spec: str, timeout: float = 0.0) -> None:
        self.spec, self.fn, self.timeout = spec, load_reward_fn(spec), timeout
        self.batched = bool(getattr(self.fn, "batched", False))
        self.name = spec.partition(":")[2].split(".")[-1]
        self._worker: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        calls = (self._in_worker if self.timeout > 0 else self._here)(prompts, completions, rows)
        out: list[float] = []
        for start, values in calls:
            if self.batched and len(values) != len(prompts):
                raise DataError(f"reward_fn={self.spec!r} returned {len(values)} scores for "
                                f"{len(prompts)} completions; return one per completion")
            out += [checked_reward(v, prompts[start + k], self.spec) for k, v in enumerate(values)]
        return out

    def _failed(self, prompts: list[str], index: int, why: str, fix: str = "") -> DataError:
        where = f"the batch of {len(prompts)} starting with" if self.batched else "prompt"
        return DataError(f"reward_fn={self.spec!r} {why} for {where} {prompts[index][:80]!r}"
                         + (f"; {fix}" if fix else ""))

    def _here(self, prompts, completions, rows):
        index = 0  # the sample being scored
        try:
            for start, values in _calls(self.fn, self.batched, prompts, completions, rows):
                yield start, values
                index = start + len(values)
        except Exception as exc:  # noqa: BLE001 - one line naming the function and the sample
            raise self._failed(prompts, min(index, len(prompts) - 1),
                               f"raised {type(exc).__name__}: {exc}") from None

    def _in_worker(self, prompts, completions, rows):
        if self._worker is None or self._worker.poll() is not None:
            self._start_worker()
        job = {"prompts": prompts, "completions": completions, "rows": rows}
        self._worker.stdin.write(json.dumps(job, default=str) + "\n")
        self._worker.stdin.flush()
        index = 0
        for _ in range(1 if self.batched else len(prompts)):
            message = self._next(self.timeout)
            if message is None:
                self.close()
                raise self._failed(prompts, index, f"did not return within --reward_timeout="
                                   f"{self.timeout:g} s", "fix the function or raise the limit")
            kind, start, values = message
            if kind == "error":
                self.close()
                raise self._failed(prompts, index, f"raised {values}")
            yield start, values
            index = start + len(values)

    def _next(self, timeout: float):
        """The worker's next message, or None after ``timeout`` seconds (or if it died)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return None if line is None else json.loads(line)

    def _start_worker(self) -> None:
        """Start the worker: a new interpreter (spawned, not forked: a fork of a large rank can
        fail for memory) that imports only the reward's module, with this rank's ``sys.path``."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._worker = subprocess.Popen([sys.executable, WORKER, self.spec], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        start_new_session=True)
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._worker.stdout, self._lines),
                         daemon=True).start()
        if self._next(WORKER_START_S) != ["ready"]:
            self.close()
            raise DataError(f"reward_fn={self.spec!r}: its worker process did not start within "
                            f"{WORKER_START_S} s; check that the module imports on its own")

    def close(self) -> None:
        """Stop the worker (killed: it may be stuck inside the function)."""
        if self._worker is not None:
            self._worker.kill()
            self._worker.wait()
            self._worker = None


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


class Rewards:
    """The weighted sum of several rewards (functions and/or a reward model); ``last`` holds each
    one's scores of the latest call, by name, for the logs."""

    def __init__(self, parts: list[tuple[str, Callable, float]]) -> None:
        self.parts, self.last = parts, {}
        self.scores_eos = any(getattr(fn, "scores_eos", False) for _, fn, _ in parts)

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict],
                 ended: list[bool] | None = None) -> list[float]:
        total = [0.0] * len(prompts)
        self.last = {}
        for name, fn, weight in self.parts:
            extra = (ended,) if getattr(fn, "scores_eos", False) and ended is not None else ()
            scores = fn(prompts, completions, rows, *extra)
            self.last[name] = scores
            self.last.update({f"{name}_{key}": values  # OpenRLHF's scores and extra logs
                              for key, values in getattr(fn, "logs", {}).items()})
            total = [t + weight * s for t, s in zip(total, scores)]
        return total


class ModelReward:
    """A reward model's score of each prompt + completion (an eval engine; same number of
    forwards on every rank: one per call). ``scores_eos``: GRPO tells it which completions ended
    with the policy's EOS, and those are scored at the reward model's own EOS."""

    scores_eos = True

    def __init__(self, engine, tokenizer, max_len: int,
                 scale: tuple[float, float] = (0.0, 1.0)) -> None:
        self.engine, self.tokenizer, self.max_len = engine, tokenizer, max_len
        self.mean, self.std = scale  # --normalize_reward: (score - mean) / std

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
        scores = ids_scores(self.engine.module, ids, self.tokenizer.pad_token_id,
                            self.engine.device)
        return [(score - self.mean) / self.std for score in scores]


def ids_scores(model: Any, ids: list[list[int]], pad_token_id: int | None,
               device: Any = "cpu") -> list[float]:
    """A reward model's score of each row of token ids, right-padded into one batch, at its
    last token (``ModelReward`` in the ranks, ``strategy.cli.serve_rm`` over HTTP)."""
    width = max(len(x) for x in ids)
    pad = pad_token_id if pad_token_id is not None else 0
    batch = {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids],
                                       device=device),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x))
                                             for x in ids], device=device)}
    return [float(score) for score in sequence_scores(model, batch).cpu()]


def model_reward(run: Any, grpo: Any) -> Any:
    """The reward model (``--reward_pretrain``) as an eval engine of ``run``'s strategy
    (``ModelReward``); in a Ray job whose reward model has a group of its own, that group
    (``strategy.rollout.remote_models.RemoteReward``, called alike)."""
    remote = remote_group("reward")
    if remote is not None:
        return remote
    model = run.strategy.from_pretrained(grpo.reward_pretrain, AutoModelForSequenceClassification,
                                         frozen=True)
    tokenizer = AutoTokenizer.from_pretrained(grpo.reward_pretrain)
    scale = (saved_reward_scale(grpo.reward_pretrain, model.config) if grpo.normalize_reward
             else (0.0, 1.0))
    return ModelReward(run.strategy.prepare(model), tokenizer, run.data.max_len, scale)


def build_rewards(run: Any, grpo: Any) -> Rewards:
    """The on-policy reward: the weighted sum (``reward_weights``) of the ``reward_fn`` callables
    and the reward model (an eval engine), each logged on its own.

    Args:
        run: the ``Run`` (its strategy and data config).
        grpo: the ``GRPOConfig`` (or PPO's) naming the rewards.

    Returns:
        A ``Rewards``: ``reward(prompts, completions, rows) -> floats``.
    """
    parts = []
    for name, weight in zip(grpo.reward_names(), grpo.weights()):
        if name == "remote":
            scorer = OpenRLHFReward(grpo.remote_rm_url, run.tokenizer.eos_token,
                                    run.data.label_key)
        elif name == "model" and grpo.reward_pretrain:
            scorer = model_reward(run, grpo)
        else:
            scorer = CallableReward(name, grpo.reward_timeout)
            name = scorer.name
        parts.append((name, scorer, weight))
    return Rewards(parts)
