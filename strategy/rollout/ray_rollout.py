"""The training ranks' side of vLLM engines on Ray (``rollout.vllm_ray`` holds the engine actor):
``RayVllmRollout`` (every training rank; ``--vllm_num_engines N``, each engine serving
``world / N`` consecutive ranks): ``sync`` streams the export's units from rank 0 to every
engine's workers at once (``weight_stream``: one process group, addressed by rank 0's node IP;
every rank still enters each gather); ``generate`` gathers an engine's ranks' rows to its first
rank, which asks the engine and hands each rank its own rows back. Every engine call has a
deadline (``--vllm_timeout``); an engine that died or raised is one line on every rank naming the
engine, its node and the call. The driver names the engines in the ranks' environment
(``ENGINES_VAR``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import torch
from transformers import GenerationConfig

from strategy.dist import checked, first_line, free_port
from strategy.model import base_model
from strategy.rollout.config import ENGINES_VAR, RolloutConfig
from strategy.rollout.vllm_checks import check_engine_split, check_head_size, check_model_len
from strategy.rollout.vllm_engine import VllmRollout, deadline, engine_failure, untied_config
from strategy.rollout.vllm_ray import UNREACHABLE, generation_settings
from strategy.rollout.vllm_requests import (
    EnginePeers,
    Requests,
    draw_seeds,
    late_tokens,
    prompt_rows,
    with_completions,
)
from strategy.rollout.weight_stream import send_weights, weight_group

STREAM_ANSWER_S = 10.0  # a broken stream: how long its engines get to say why (a dead worker)
WATCHDOG_GRACE_S = 30.0  # past its Ray waits' own deadlines, before a rank ends itself


def engine_names() -> dict | None:
    """The driver's engines for this job (``ENGINES_VAR``), or None outside a Ray job."""
    value = os.environ.get(ENGINES_VAR)
    return json.loads(value) if value else None


class RayVllmRollout(VllmRollout):
    """The driver's vLLM engine actors, each shared by ``world / N`` consecutive ranks (every
    rank constructs this alike: it is collective).

    Args:
        engine: the policy's training engine (any ZeRO stage; a PEFT model is merged).
        config: the ``RolloutConfig``.
        max_model_len: the longest prompt + completion it will see.
        seed: the first engine's seed (engine i: seed + i).
    """

    def __init__(self, engine: Any, config: RolloutConfig, max_model_len: int,
                 seed: int) -> None:
        import ray  # the optional extra: a Ray job only

        self.source, self.config = engine.module, config
        self.rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        spec = engine_names()
        self.names = spec["names"]
        self.engines = [ray.get_actor(name, namespace=spec["namespace"]) for name in self.names]
        self.per = world // len(self.engines)
        self.first = self.rank - self.rank % self.per  # the rank that asks this rank's engine
        self.places: list[dict] = []  # each engine's node, as its line names it
        self.places = self._get([e.where.remote() for e in self.engines], "start")
        self._peers = EnginePeers(self.per)
        model = base_model(self.source)
        check_head_size(model.config)
        check_model_len(model.config, max_model_len)
        check_engine_split(model.config, config.vllm_tensor_parallel_size)
        untied, self._tied = untied_config(model)
        self._group: Any = None  # the sync's process group, on rank 0
        checked(self._start, untied.to_json_string(), str(next(self.source.parameters()).dtype),
                max_model_len, seed, make=engine_failure(self.describe, "start"))
        self._prepare_stream()

    def describe(self, rank: int) -> str:
        index, first = rank // self.per, rank - rank % self.per
        place = self.places[index] if self.places else None
        node = f" on node {place['ip']} {place['node_id'][:8]}" if place else ""
        return (f"vLLM engine {index} (Ray actor {self.names[index]}{node}, serving ranks "
                f"{first}-{first + self.per - 1})")

    def _call(self, name: str, fn: Any) -> Any:
        """As the in-rank engine's, but every wait here has a deadline of its own that raises (an
        engine call is a Ray reference): the watchdog, which ends the rank's process, fires only
        past them (twice ``--vllm_timeout``: a sync's stream, then a look at its answer), so a
        stopped engine is a line of its own, not a dead rank."""
        seconds = 2 * self.config.vllm_timeout + WATCHDOG_GRACE_S
        with deadline(seconds, f"the {self.describe(self.rank)} ({name})"):
            return checked(fn, make=engine_failure(self.describe, name))

    def _get(self, refs: list, call: str, engines: list[int] | None = None) -> list:
        """The answers of engines ``engines`` (all, in order, by default) to ``refs``, within
        ``--vllm_timeout``; a dead engine, an error in one or a wait past the deadline as one
        line naming the engine and its node."""
        import ray  # the optional extra: a Ray job only

        out = []
        for index, ref in zip(engines or range(len(refs)), refs):
            try:
                out.append(ray.get(ref, timeout=self.config.vllm_timeout))
            except ray.exceptions.GetTimeoutError:
                self._end_hung(index)
                raise TimeoutError(f"engine {index} did not answer {call} within "
                                   f"--vllm_timeout={self.config.vllm_timeout:g} s") from None
            except ray.exceptions.RayActorError as exc:
                why = "its node is gone" if self._node_lost(index) else UNREACHABLE \
                    if isinstance(exc, ray.exceptions.ActorUnavailableError) else first_line(exc)
                raise ConnectionError(f"engine {index}'s actor died in {call} ({why})") from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if exc.cause is not None else exc
                raise RuntimeError(f"engine {index} failed in {call}: "
                                   f"{type(cause).__name__}: {first_line(cause)}") from None
        return out

    def _node_lost(self, index: int) -> bool:
        """Engine ``index``'s node is no longer alive in the cluster."""
        import ray  # the optional extra: a Ray job only

        if not self.places:
            return False
        node = self.places[index]["node_id"]
        return not any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())

    def _end_hung(self, index: int) -> None:
        """Engine ``index`` missed its deadline (stopped, hung): its actor is killed now, as it
        would be at the teardown after another ``--vllm_timeout`` of waiting on its shutdown;
        the driver removes what it left (``remove_engine_files``)."""
        import ray  # the optional extra: a Ray job only

        ray.kill(self.engines[index])

    def _start(self, config_json: str, dtype: str, max_model_len: int, seed: int) -> None:
        """On rank 0: every engine started, then the sync's group joined by all their
        workers."""
        import ray  # the optional extra: a Ray job only

        if self.rank != 0:
            return
        dtype = dtype.removeprefix("torch.")
        self._get([e.start.remote(config_json, dtype, asdict(self.config), max_model_len,
                                  seed + i) for i, e in enumerate(self.engines)], "start")
        tp, host, port = self.config.vllm_tensor_parallel_size, ray.util.get_node_ip_address(), \
            free_port()
        size = 1 + len(self.engines) * tp
        joined = [e.join_weights.remote(host, port, 1 + i * tp, size, self.config.vllm_timeout)
                  for i, e in enumerate(self.engines)]
        with deadline(self.config.vllm_timeout, "the vLLM engines' weight group (start)"):
            self._group = weight_group(port, 0, size, self.config.vllm_timeout, host=host)
        self._get(joined, "start")

    def _sync(self) -> None:
        import ray  # the optional extra: a Ray job only

        # no look for an engine already gone before the stream (a live engine's call ends only
        # after it, so any wait is paid in full: 0.02 s of a 0.06 s sync): a gone engine's
        # process group breaks the stream, or its call's error ends the sync below
        refs = [e.receive_weights.remote() for e in self.engines] if self.rank == 0 else []
        stream = self._weights(copy=False)  # every rank enters every gather
        if self.rank == 0:
            try:
                send_weights(self._group, stream)
            except Exception:  # an engine gone mid-stream: that, not the broken pipe; one
                # that never took it (stopped, hung) already had --vllm_timeout to do so
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=STREAM_ANSWER_S)
                self._get(done, "sync", [refs.index(ref) for ref in done])
                late = [refs.index(ref) for ref in refs if ref not in done]
                if late:
                    self._end_hung(late[0])
                    raise TimeoutError(f"engine {late[0]} did not take the weight stream within "
                                       f"--vllm_timeout={self.config.vllm_timeout:g} s") from None
                raise
        else:
            for _ in stream:
                pass
        self._get(refs, "sync")

    def _ask(self, requests: Requests, generation_config: GenerationConfig) -> Any:
        """On an engine's first rank: its request under way (a Ray reference)."""
        if self.rank != self.first:
            return None
        return self.engines[self.rank // self.per].generate.remote(
            requests.prompts, requests.seeds, generation_settings(generation_config))

    def _answer(self, ref: Any) -> Any:
        """The engine's answer to ``_ask`` (every rank alike: an error is raised on all)."""
        return self._call("generate", lambda: self._get(
            [ref], "generate", [self.rank // self.per])[0] if ref is not None else None)

    def sync_in_flight(self) -> None:
        """``sync`` while generations run ahead in the engines (partial rollouts): each
        stops between two engine steps, takes the weights, and goes on under them."""
        self._call("sync", self._sync_held)

    def _sync_held(self) -> None:
        holds = [e.hold.remote(self.config.vllm_timeout) for e in self.engines] \
            if self.rank == 0 else []
        try:
            self._get(holds, "sync")
            self._sync()
        finally:
            for engine in self.engines if self.rank == 0 else []:
                engine.release.remote()

    def _rows(self, answer: Any, requests: Requests, input_ids: torch.Tensor,
              generation_config: GenerationConfig) -> torch.Tensor:
        """This rank's rows of its engine's answer (handed on from the engine's first rank)."""
        tokens, logprobs, split = self._peers.spread(answer)
        rows = slice(requests.start, requests.start + input_ids.shape[0])
        self.logprobs, self.late = logprobs[rows], late_tokens(tokens[rows], split, rows)
        return with_completions(input_ids, tokens[rows], generation_config.pad_token_id)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        seeds = draw_seeds(input_ids.shape[0], generator)
        requests = self._peers.share(prompt_rows(input_ids, attention_mask), seeds)
        answer = self._answer(self._ask(requests, generation_config))
        return self._rows(answer, requests, input_ids, generation_config)

    def start_generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       generation_config: GenerationConfig) -> RayAhead:
        seeds = draw_seeds(input_ids.shape[0])
        requests = self._peers.share(prompt_rows(input_ids, attention_mask), seeds)
        return RayAhead(self, self._ask(requests, generation_config),
                        (requests, input_ids, generation_config))


class RayAhead:
    """A generation running in its engine's actor while the step before trains (``Ahead``'s
    interface): ``join`` waits for it (within the deadline), ``wait`` (collective) gives
    ``(output, log-probs)``."""

    def __init__(self, rollout: RayVllmRollout, ref: Any, request: tuple) -> None:
        self.rollout, self.ref, self.request = rollout, ref, request

    def join(self) -> None:
        import ray  # the optional extra: a Ray job only

        if self.ref is not None:
            ray.wait([self.ref], timeout=self.rollout.config.vllm_timeout)

    def wait(self) -> tuple[torch.Tensor, list[list[float]] | None]:
        out = self.rollout._rows(self.rollout._answer(self.ref), *self.request)
        return out, self.rollout.logprobs
