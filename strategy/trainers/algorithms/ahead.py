"""What GRPO (and PPO) do with a rollout engine of their own (vLLM), beside the ``hf`` loop:
``--async_rollouts 1`` (the next rollout generated on a thread while this one trains, saved in
flight with each checkpoint). A mixin of ``GRPOTrainer``: it reads the trainer's prompts, settings,
engine and experience stage.

With an environment (``--agent_func_path``, ``--tools``) the next rollout's episodes are played
ahead, whole, on a thread of their own (``Played``): each turn's generation and environment step
there, its collectives (the turns' lockstep, an environment's error on every rank) over a process
group of their own (``strategy.apart``), its seeds from a generator drawn when it starts, so a
rerun plays the same episodes. The rewards of tools' answers are scored after, on the main
thread."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from transformers import GenerationConfig

from strategy.dist import checked
from strategy.errors import RankFailedError
from strategy.rollout.vllm_engine import Ahead, Done, deadline
from strategy.trainers.algorithms.completions import sampling_rng
from strategy.trainers.algorithms.episodes import Episode
from strategy.trainers.algorithms.experience import repeated


class Played(Ahead):
    """Episodes played on a thread of their own (``Ahead``'s thread): ``join`` waits for them
    within ``seconds`` (None: no bound), ``wait`` (collective) gives them, or raises an error of
    any rank's on every rank."""

    def __init__(self, fn: Callable[[], list[Episode]], seconds: float | None) -> None:
        super().__init__(fn, 0, seconds or 0.0, lambda rank: "")
        self.seconds = seconds

    def join(self) -> None:
        """Until the episodes are played (this rank alone)."""
        if self.seconds is None:
            return self._thread.join()
        with deadline(self.seconds, "the episodes played ahead",
                      "--max_turns x (--vllm_timeout + --agent_timeout)",
                      "raise --vllm_timeout or --agent_timeout"):
            self._thread.join()

    def wait(self) -> list[Episode]:
        """The episodes (collective)."""
        self.join()
        kind, value = self._out[0]
        if kind == "error" and isinstance(value, RankFailedError):
            raise value  # raised on every rank alike already, by a collective on the thread

        def result() -> list[Episode]:
            if kind == "error":
                raise value
            return value

        return checked(result)


class EngineRollouts:
    """``rollout_ahead`` and its checkpoint state (``ahead_state``, ``load_ahead``)."""

    _ahead: tuple | None  # (prompts, generation, version): the rollout in flight

    def rollout_ahead(self) -> tuple[list[dict], dict]:
        """``--async_rollouts 1``: this step's rollout was generated while the step before it
        trained, from the weights before that update (the first one: now); it is scored here,
        then the next rollout's generation starts on a thread of its own before this one trains.
        ``staleness`` logs how many updates behind the policy its samples are.

        Returns:
            ``(micro-batches, metrics)``, as ``rollout``'s.
        """
        start = time.perf_counter()
        if self._ahead is None:  # the first rollout (or a resume without one in flight)
            self._ahead = self._launch(self.next_prompts())
        batch, generation, version = self._ahead
        self._sync_in_flight()
        if self.episodes is not None:
            late, played = {}, generation.wait()
            sampled = self.played(batch, self.grpo.group_size, [
                Episode(**e) if isinstance(e, dict) else e for e in played])  # a saved one
        else:
            out, engine = generation.wait()
            late = self._late_share(generation)
            sampled = self._scored(batch, out[:, batch["prompt_ids"].shape[1]:], engine)
        self._ahead = None
        self._components = sampled.components
        batches, metrics = self.experience(sampled)
        rollout = self.global_step // self.grpo.ppo_epochs
        if rollout + 1 < self.step_plan.total_steps // self.grpo.ppo_epochs:
            self._ahead = self._launch(self.next_prompts())
        return batches, {**metrics, **self._sync_metric(), **late,
                         "staleness": (float(rollout - version), 1),
                         "generation_s": (time.perf_counter() - start, 1)}

    def _sync_in_flight(self) -> None:
        """``--partial_rollouts``: the policy moved since the engine's last sync, so the
        rollout under way takes the new weights now, between two engine steps (a finished one:
        a plain sync)."""
        if self.rollout_config.partial_rollouts:
            self._sync_rollouts(in_flight=True)

    def _late_share(self, generation: Any) -> dict:
        """``--partial_rollouts``: the share of this rank's sampled tokens that came after the
        sync in flight (0 when the rollout had ended before it; none for a saved rollout)."""
        if not self.rollout_config.partial_rollouts or isinstance(generation, Done):
            return {}
        late, total = self.rollouts.late or (0, 0)
        return {"late_tokens": (late / total if total else 0.0, 1)}

    def _launch(self, batch: dict) -> tuple[dict, Any, int]:
        """Start generating ``batch``'s rollout from the current weights: the engine synced, the
        seeds drawn now from the generator of the step it will train at."""
        self._sync_rollouts()
        rollout = self.global_step // self.grpo.ppo_epochs  # updates so far: the version
        step = (self._rounds_drawn - 1) * self.grpo.ppo_epochs  # where ``batch`` will train
        with sampling_rng(self.strategy.config.seed, step, self.strategy.rank):
            if self.episodes is not None:
                ahead = self._play_ahead(batch)
            else:
                ahead = self.rollouts.start_generate(*self._grouped(batch), GenerationConfig(
                    **self._settings(True)))
        return batch, ahead, rollout

    def _play_ahead(self, batch: dict) -> Played:
        """``batch``'s episodes played on a thread of their own, from the engine as synced
        now, seeded from a generator drawn now (from the step's sampling generator)."""
        apart = self.strategy.apart()  # collective the first time: here, on every rank alike
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        prompt_ids, prompts, rows = repeated(batch, self.grpo.group_size)
        turn = self.model_turns(True, generator)

        def run() -> list[Episode]:
            with apart():
                return self.episodes.run(prompts, prompt_ids, rows, self.answer_key, turn,
                                         generator)

        ep, timeout = self.episodes, self.rollout_config.vllm_timeout
        return Played(run, None if not ep.timeout else ep.max_turns * (timeout + ep.timeout))

    def ahead_state(self) -> list:
        """Every rank's rollout in flight (waited for; collective), for the checkpoint: by rank,
        ``(prompts, (output, log-probs), version)`` or None."""
        ahead = None
        if self._ahead is not None:
            batch, generation, version = self._ahead
            self._sync_in_flight()  # as the next rollout_ahead would, before the rest
            done = generation.wait()
            if self.episodes is not None:  # plain values: the checkpoint loads weights_only
                done = [dataclasses.asdict(e) if isinstance(e, Episode) else e for e in done]
            ahead = (batch, done, version)
            self._ahead = (batch, Done(ahead[1]), version)
        return self.strategy.all_gather_object(ahead)  # rank 0 saves it

    def load_ahead(self, ahead: list) -> None:
        """This rank's saved rollout in flight back (``ahead_state``'s list; saved at another
        world size: none, its prompts drawn anew)."""
        mine = ahead[self.strategy.rank] if len(ahead) == self.strategy.world_size else None
        self._ahead = None if mine is None else (mine[0], Done(mine[1]), mine[2])
        if len(ahead) != self.strategy.world_size and any(a is not None for a in ahead):
            self._rounds_drawn -= 1
