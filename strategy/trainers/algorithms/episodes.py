"""Multi-turn episodes (``--agent_func_path``): the model acts, an environment (``strategy.agents``)
answers, the model acts again; only the model's own tokens train.

``EpisodeRunner.run`` plays a rollout's episodes together: each turn, every live episode's next
model turn comes from one ``generate`` call (all of them batched on the engine), then every live
episode's ``step`` runs (concurrently when ``async def``), on a thread bounded by
``--agent_timeout``. Every rank plays the same number of turns (a rank whose episodes all ended
generates one throw-away token meanwhile), so engines that run collectives stay in step, and an
environment that raises or hangs on one rank stops every rank with one line naming the file, the
episode and the turn.

An episode is its prompt, then its turns' tokens back to back: the model's (``model`` True), then
the environment's feedback, tokenized as OpenRLHF does (no special tokens added). Feedback is
context only: its labels are ``IGNORE``, so no loss, advantage, KL or token count reaches it,
and the log-probs are the model tokens'. Each turn's reward sits on its last model token
(``turn_rewards``) for the estimators that take rewards per token as they are (PPO's GAE,
REINFORCE++); the group estimators normalize the episode's total.

Python's and NumPy's random generators are seeded from the step's sampling generator while the
episodes run (and put back after), so an environment drawing from them replays exactly on resume.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from strategy.errors import DataError
from strategy.trainers.algorithms.remote_reward import finite_number

# rows of context -> (each row's new tokens up to its end, their engine log-probs or None)
Generate = Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]] | None]]


@dataclass
class Episode:
    """One episode of a rollout.

    Attributes:
        prompt_ids: its first context's tokens.
        text: its context as text so far (``observation_text``).
        label: the row's answer (``--output_key``), for the environment.
        row: the dataset row.
        tokens: everything after the prompt: model turns and feedback.
        model: per entry of ``tokens``, whether the model generated it.
        engine_logps: per entry of ``tokens``, the engine's log-prob (0 on feedback; vLLM).
        rewards: each turn's reward.
        turn_ends: each turn's last model token, as an index into ``tokens``.
        score: the last ``scores`` the environment gave (None: the reward).
        done: the environment ended it (False: cut by ``--max_turns`` or ``--max_len``).
        logs: the last ``extra_logs``.
    """

    prompt_ids: list[int]
    text: str
    label: Any
    row: dict
    tokens: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    engine_logps: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    score: float | None = None
    done: bool = False
    logs: dict = field(default_factory=dict)

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def room(self, max_len: int) -> int:
        """Tokens the context may still grow by."""
        return max_len - len(self.prompt_ids) - len(self.tokens)

    def add(self, tokens: list[int], by_model: bool, logps: list[float] | None = None) -> None:
        self.tokens += tokens
        self.model += [by_model] * len(tokens)
        self.engine_logps += list(logps[:len(tokens)]) if logps else [0.0] * len(tokens)

    def last_turn(self) -> list[int]:
        """The model's latest turn's tokens."""
        end = self.turn_ends[-1] + 1
        start = end
        while start > 0 and self.model[start - 1]:
            start -= 1
        return self.tokens[start:end]


@contextmanager
def python_rng(seed: int) -> Iterator[None]:
    """Python's and NumPy's global generators seeded with ``seed`` inside the block, as before
    after it."""
    states = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


class EpisodeRunner:
    """Plays episodes of an agent class, batched per turn.

    Args:
        agent_cls: makes one episode's environment (``strategy.agents.load_agent``'s class).
        source: how errors name it, e.g. ``agent_func_path='env.py'``.
        tokenizer: decodes turns, tokenizes observations and feedback.
        max_turns: model turns per episode at most.
        max_new_tokens: tokens per model turn at most.
        max_len: prompt + turns + feedback at most.
        timeout: seconds one turn's environment calls may take (0: no limit).
        strategy: the strategy, for its collectives (``checked``: an error on any rank raised
            on every rank; ``all_reduce``, ``all_gather_object``).
        sampling: the configured sampling (``temperature``, ``top_p``, ``top_k``), handed to
            each ``step`` as ``states["sampling_params"]``; a step that returns other values is
            refused.
    """

    def __init__(self, agent_cls: Callable[[], Any], source: str, tokenizer: Any, max_turns: int,
                 max_new_tokens: int, max_len: int, timeout: float, strategy: Any,
                 sampling: dict | None = None) -> None:
        self.agent_cls, self.source, self.tokenizer = agent_cls, source, tokenizer
        self.max_turns, self.max_new_tokens, self.max_len = max_turns, max_new_tokens, max_len
        self.timeout, self.strategy, self.sampling = timeout, strategy, dict(sampling or {})

    def anywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (one small all-reduce)."""
        return bool(self.strategy.all_reduce(float(flag), op="max"))

    def metrics(self, episodes: list[Episode]) -> dict:
        """``(sum, count)`` metrics of played episodes (collective: every rank logs the same
        names): model ``turns``, ``feedback_tokens``, and each numeric ``extra_logs`` entry of
        their last step as ``agent_<name>``."""
        n = len(episodes)
        out = {"turns": (float(sum(len(e.turn_ends) for e in episodes)), n),
               "feedback_tokens": (float(sum(len(e.model) - sum(e.model) for e in episodes)), n)}
        mine = sorted({key for e in episodes for key in e.logs})
        for name in sorted({k for part in self.strategy.all_gather_object(mine) for k in part}):
            values = [e.logs[name] for e in episodes if name in e.logs]
            out[f"agent_{name}"] = (float(sum(values)), len(values))
        return out

    def run(self, prompts: list[str], prompt_ids: list[list[int]], rows: list[dict],
            label_key: str | None, generate: Generate,
            generator: torch.Generator | None = None) -> list[Episode]:
        """Every episode of this rank's share of a rollout, played to its end (collective).

        Args:
            prompts: each episode's prompt text (the observation ``reset`` gets).
            prompt_ids: its tokens.
            rows: its dataset row.
            label_key: the row key ``label`` reads (None: no label).
            generate: the engine's batched generation (rows of context, max new tokens).
            generator: where the environment's seed is drawn from (None: the global generator;
                episodes played on a thread of their own pass their own).

        Returns:
            The episodes, in order.
        """
        episodes = [Episode(list(ids), text, row.get(label_key) if label_key else None, row)
                    for text, ids, row in zip(prompts, prompt_ids, rows)]
        with python_rng(int(torch.randint(0, 2**62, (1,), generator=generator))):
            agents = self._reset(episodes)
            for turn in range(self.max_turns):
                live = [i for i, e in enumerate(episodes)
                        if not e.done and e.room(self.max_len) > 0]
                if not self.anywhere(bool(live)):
                    break
                self._model_turn([episodes[i] for i in live], generate, episodes)
                self._environment_turn(live, episodes, agents, turn)
        return episodes

    def _reset(self, episodes: list[Episode]) -> list[Any]:
        agents: list[Any] = [None] * len(episodes)

        async def reset(k: int) -> None:
            agents[k] = self.agent_cls()
            out = await _awaited(agents[k].reset({"observation": episodes[k].text,
                                                  "label": episodes[k].label,
                                                  "row": episodes[k].row}))
            text = out.get("observation") if isinstance(out, dict) else None
            if not isinstance(text, str):
                raise TypeError(f"reset returned {type(out).__name__} without a text "
                                f"'observation'")
            if text != episodes[k].text:  # a context of the environment's own
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                cut = self.max_len - self.max_new_tokens  # the loader's bound on a prompt
                episodes[k].prompt_ids, episodes[k].text = ids[-cut:], text

        self._calls("reset", [(k, reset) for k in range(len(episodes))], episodes, None)
        return agents

    def _model_turn(self, live: list[Episode], generate: Generate,
                    episodes: list[Episode]) -> None:
        budgets = [min(self.max_new_tokens, e.room(self.max_len)) for e in live]
        rows = [e.context for e in live] or [episodes[0].prompt_ids[-1:]]  # every rank generates
        new, logps = generate(rows, max(budgets, default=1))
        for k, (e, budget) in enumerate(zip(live, budgets)):
            tokens = new[k][:budget] or [self.tokenizer.eos_token_id]
            e.add(tokens, True, logps[k] if logps else None)
            e.turn_ends.append(len(e.tokens) - 1)

    def _environment_turn(self, live: list[int], episodes: list[Episode], agents: list[Any],
                          turn: int) -> None:
        results: dict[int, Any] = {}
        actions = {k: self.tokenizer.decode(episodes[k].last_turn(), skip_special_tokens=True)
                   for k in live}

        async def step(k: int) -> None:
            e = episodes[k]
            results[k] = await _awaited(agents[k].step({
                "observation_text": e.text, "action_text": actions[k], "label": e.label,
                "row": e.row, "turn": turn, "sampling_params": dict(self.sampling)}))

        self._calls("step", [(k, step) for k in live], episodes, turn)
        for k in live:
            e = episodes[k]
            reward, feedback, done, score, logs = self._answer(results[k], k, turn, e)
            e.rewards.append(reward)
            e.score, e.logs, e.done = score, logs, done
            e.text = e.text + actions[k] + feedback
            ids = self.tokenizer(feedback, add_special_tokens=False)["input_ids"] if feedback \
                else []
            e.add(ids[:max(e.room(self.max_len), 0)], False)

    def _answer(self, out: Any, k: int, turn: int, e: Episode) -> tuple:
        """A ``step`` result's fields, checked: one line naming the file, episode and turn."""
        where = self._where(k, turn, e)
        if not isinstance(out, dict) or not {"rewards", "done"} <= set(out):
            raise DataError(f"{where}: step returned {_shape(out)}; return a dict with rewards, "
                            "environment_feedback and done")
        reward = _number(out["rewards"], "rewards", where)
        score = out.get("scores")
        score = None if score is None else _number(score, "scores", where)
        feedback = out.get("environment_feedback") or ""
        if not isinstance(feedback, str):
            raise DataError(f"{where}: environment_feedback is {type(feedback).__name__}; "
                            "return text")
        changed = _changed_sampling(out.get("sampling_params"), self.sampling)
        if changed:
            raise DataError(f"{where}: step returned sampling_params with {changed}; per-turn "
                            "sampling is not applied here (the loss's log-probs are those of "
                            "--temperature/--top_p/--top_k): return states['sampling_params'] "
                            "as given, or None")
        logs = {}  # the numbers among them (a flag as 0 or 1)
        for key, value in (out.get("extra_logs") or {}).items():
            number = float(value) if isinstance(value, bool) else finite_number(value)
            if number is not None:
                logs[key] = number
        return reward, feedback, bool(out["done"]), score, logs

    def _where(self, k: int, turn: int | None, e: Episode) -> str:
        at = "reset" if turn is None else f"turn {turn}"
        return f"{self.source}: episode {k} (prompt {e.text[:40]!r}), {at}"

    def _calls(self, name: str, calls: list[tuple[int, Callable]], episodes: list[Episode],
               turn: int | None) -> None:
        """The calls (coroutines) run concurrently on a thread of their own, at most
        ``timeout`` seconds; an error or a hang on any rank is raised on every rank (collective).
        """
        self.strategy.checked(self._run_bounded, name, calls, episodes, turn)

    def _run_bounded(self, name: str, calls: list[tuple[int, Callable]],
                     episodes: list[Episode], turn: int | None) -> None:
        pending = {k for k, _ in calls}
        failure: list[tuple[int, BaseException]] = []

        async def one(k: int, fn: Callable) -> None:
            try:
                await fn(k)
            except Exception as exc:  # noqa: BLE001 - the user's environment: named below
                failure.append((k, exc))
            pending.discard(k)

        async def every() -> None:
            await asyncio.gather(*(one(k, fn) for k, fn in calls))

        thread = threading.Thread(target=asyncio.run, args=(every(),), daemon=True)
        thread.start()
        thread.join(self.timeout or None)
        if thread.is_alive():
            k = min(pending)
            raise DataError(f"{self._where(k, turn, episodes[k])}: {name} did not return within "
                            f"--agent_timeout={self.timeout:g} s; fix the environment or raise "
                            "--agent_timeout")
        if failure:
            k, exc = min(failure, key=lambda item: item[0])
            if isinstance(exc, DataError):
                raise exc
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise DataError(f"{self._where(k, turn, episodes[k])}: {name} raised "
                            f"{type(exc).__name__}: {first}")


async def _awaited(value: Any) -> Any:
    """``value``, awaited when a coroutine (``async def`` or plain ``def`` methods alike)."""
    return await value if inspect.isawaitable(value) else value


def _changed_sampling(asked: Any, configured: dict) -> str:
    """What a step's ``sampling_params`` (a dict, or an object with attributes as vLLM's
    ``SamplingParams``) sets apart from ``configured``: ``"temperature=0.5 (configured 1.0)"``,
    or "" when nothing (None, or the configured values)."""
    if asked is None:
        return ""
    if isinstance(asked, dict):
        values = dict(asked)
    else:
        values = {key: getattr(asked, key) for key in configured if hasattr(asked, key)}
    changed = [f"{key}={value!r} (configured {configured.get(key)!r})"
               for key, value in values.items()
               if value is not None and (key not in configured or value != configured[key])]
    return ", ".join(changed)


def _number(value: Any, name: str, where: str) -> float:
    number = finite_number(value)
    if number is None:
        value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        raise DataError(f"{where}: {name} is {value!r}; return a finite number (or a "
                        "one-element tensor)")
    return number


def _shape(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict of {sorted(value)}"
    return type(value).__name__


def turn_values(episodes: list[Episode]) -> list[list[float]]:
    """Each episode's turn rewards laid along its tokens (on each turn's last model token)."""
    out = []
    for e in episodes:
        values = [0.0] * len(e.tokens)
        for end, reward in zip(e.turn_ends, e.rewards):
            values[end] += reward
        out.append(values)
    return out

