"""OpenRLHF's reward sources (``--remote_rm_url``; OpenRLHF's ``--reward.remote_url``): a Python
file whose ``reward_func(queries, prompts, labels)`` returns ``{"rewards", "scores",
"extra_logs"}`` (OpenRLHF's examples/python/reward_func.py form, unchanged), or reward servers,
one URL or several comma-separated, each answering OpenRLHF's ``POST {"query": [...], "prompts":
[...], "labels": [...]}`` with the same keys (``python -m strategy.cli.serve_rm`` serves a reward
model so).

What they get is what OpenRLHF sends: each query is the prompt and its completion as text, with
the completion's end token when it ended (OpenRLHF decodes prompt + completion with special tokens
kept); each label is the row's ``--label_key`` column ("" where the row has none). ``rewards``
(tensors or lists, one per query) trains; ``scores`` (the rewards when absent) and each of
``extra_logs`` are logged beside them (``reward_remote_score``, ``reward_remote_<key>``; a scalar
extra log counts for every query). A rollout's queries are split into contiguous shards, one per
server, posted at once; each request is tried 5 times, a second apart, each try within 180 s.
A server that stays down, or an answer without ``rewards``, with the wrong count or a value that
is not a finite number, stops every rank with one line naming the source (the step is not taken).
``finite_number`` is the check every reward source shares.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from strategy.errors import DataError, fail

TRIES, PAUSE_S, TIMEOUT_S = 5, 1.0, 180.0  # OpenRLHF's


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (a one-element tensor's too; not a
    bool), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def load_reward_file(path: str) -> Callable[..., Any]:
    """The ``reward_func`` a Python file defines (OpenRLHF's file form)."""
    try:
        spec = importlib.util.spec_from_file_location("reward_func", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, SyntaxError) as exc:
        fail("remote_rm_url", path, f"cannot load it ({type(exc).__name__}: {exc})")
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        fail("remote_rm_url", path, "the file must define reward_func(queries, prompts, labels)")
    return fn


def server_urls(spec: str) -> list[str]:
    """``URL[,URL...]``, each http:// or https://."""
    urls = [url.strip() for url in spec.split(",") if url.strip()]
    bad = [url for url in urls if not url.startswith(("http://", "https://"))]
    if not urls or bad:
        fail("remote_rm_url", spec, "give a reward_func file (.py) or reward server URLs, "
             "comma-separated, each http://HOST:PORT/PATH (e.g. http://127.0.0.1:5000/get_reward)")
    return urls


def check_remote(spec: str) -> None:
    """A reward_func file that loads, or server URLs that parse; else one line (before any
    model loads)."""
    if spec.endswith(".py"):
        load_reward_file(spec)
    else:
        server_urls(spec)


def _numbers(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return value.flatten().tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value]


class OpenRLHFReward:
    """OpenRLHF's reward file or servers as a reward of ``Rewards`` (``scores_eos``: it is told
    which completions ended, to close their queries with the end token)."""

    scores_eos = True
    name = "remote"

    def __init__(self, spec: str, eos_token: str, label_key: str | None,
                 tries: int = TRIES, pause: float = PAUSE_S, timeout: float = TIMEOUT_S) -> None:
        self.spec, self.eos, self.label_key = spec, eos_token or "", label_key
        self.tries, self.pause, self.timeout = tries, pause, timeout
        self.fn = load_reward_file(spec) if spec.endswith(".py") else None
        self.urls = [] if self.fn is not None else server_urls(spec)
        self.logs: dict[str, list[float]] = {}  # the latest call's scores and extra logs

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict],
                 ended: list[bool] | None = None) -> list[float]:
        ended = ended if ended is not None else [False] * len(prompts)
        queries = [p + c + (self.eos if e else "") for p, c, e in zip(prompts, completions, ended)]
        labels = [row.get(self.label_key, "") if self.label_key else "" for row in rows]
        if self.fn is not None:
            parts = [self._parsed(self._ask_file(queries, prompts, labels), len(queries))]
        else:
            parts = self._ask_servers(queries, prompts, labels)
        rewards, self.logs = [], {}  # the logs: the scores and each extra log, per query
        for part_rewards, logs in parts:
            rewards += part_rewards
            for key, values in logs.items():
                self.logs.setdefault(key, []).extend(values)
        return rewards

    def _parsed(self, answer: Any, count: int) -> tuple[list[float], dict[str, list]]:
        """One answer for ``count`` queries: its rewards, and its scores (the rewards when
        absent) and extra logs (a scalar counted for every query) by log name."""
        rewards = self._values(answer, "rewards", count)
        logs = {"score": self._values(answer, "scores", count)
                if answer.get("scores") is not None else rewards}
        for key, value in (answer.get("extra_logs") or {}).items():
            values = _numbers(value)
            logs[str(key)] = values * count if len(values) == 1 else values
        return rewards, logs

    def _values(self, answer: Any, key: str, count: int) -> list[float]:
        """``answer[key]`` as ``count`` finite floats, else one line naming the source."""
        if not isinstance(answer, dict) or key not in answer:
            raise DataError(f"remote_rm_url={self.spec!r} answered without {key!r} "
                            f"({str(answer)[:120]}); return a dict with 'rewards' (and optionally "
                            "'scores', 'extra_logs'), one value per query")
        values = _numbers(answer[key])
        if len(values) != count:
            raise DataError(f"remote_rm_url={self.spec!r} returned {len(values)} {key} for "
                            f"{count} queries; return one per query")
        numbers = [finite_number(v) for v in values]
        if None in numbers:
            bad = values[numbers.index(None)]
            raise DataError(f"remote_rm_url={self.spec!r} returned {key} value {bad!r}; return "
                            "finite numbers")
        return numbers

    def _ask_file(self, queries: list[str], prompts: list[str], labels: list) -> Any:
        try:
            return self.fn(queries, prompts, labels)
        except Exception as exc:  # noqa: BLE001 - one line naming the file and the query
            raise DataError(f"remote_rm_url={self.spec!r}: reward_func raised "
                            f"{type(exc).__name__}: {exc} (first query {queries[0][:80]!r})") \
                from None

    def _ask_servers(self, queries: list[str], prompts: list[str], labels: list) -> list:
        """Contiguous shards, one per server, posted at once; each answer parsed, in order."""
        size = -(-len(queries) // len(self.urls))
        shards = [(url, slice(i * size, (i + 1) * size)) for i, url in enumerate(self.urls)
                  if i * size < len(queries)]
        with ThreadPoolExecutor(len(shards)) as pool:
            answers = list(pool.map(lambda s: self._post(s[0], {
                "query": queries[s[1]], "prompts": prompts[s[1]], "labels": labels[s[1]]}),
                shards))
        return [self._parsed(answer, len(queries[rows]))
                for (_, rows), answer in zip(shards, answers)]

    def _post(self, url: str, body: dict) -> Any:
        """One shard's answer: ``tries`` tries, ``pause`` s apart, each within ``timeout`` s."""
        data, error = json.dumps(body).encode(), ""
        for attempt in range(self.tries):
            request = urllib.request.Request(url, data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except (urllib.error.URLError, OSError, ValueError) as exc:
                error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            if attempt + 1 < self.tries:
                time.sleep(self.pause)
        raise DataError(f"remote_rm_url: the reward server {url} did not answer after "
                        f"{self.tries} tries {self.pause:g} s apart (last: {error}); start it "
                        "(python -m strategy.cli.serve_rm) or fix the URL")
