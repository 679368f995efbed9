"""Partial rollouts (``--partial_rollouts``, OpenRLHF's ``--train.partial_rollout_enable``): a
generation running ahead of training (``--async_rollouts 1``) stops between two engine steps
when the policy has moved, the engine takes the new weights, and the unfinished samples go on
under them. OpenRLHF does it with vLLM's ``pause_generation(mode="keep")``; here the generating
thread drives vLLM's engine step by step (``run_requests``) and waits at a ``StepGate``.

- A sample's tokens sampled before the sync come from the old weights, the rest from the new;
  their log-probs are the weights' that sampled them (vLLM's own), which is what the engine
  importance-sampling correction (``--is_correction``) compares per token. ``split`` keeps,
  for each request, how many of its tokens came before the sync.
- The unfinished requests' cached keys and values are dropped with the sync (vLLM preempts
  them: ``reset_prefix_cache(reset_running_requests=True)``), so the new weights recompute
  their prompt and tokens so far before going on: no token of the new weights attends to the
  old weights' cache.
- The ranks of one engine (``--vllm_tensor_parallel_size``) step in lockstep (each step's
  collectives need them all), so they must stop before the same step: each first stops its
  generation before the next step it would start (``cap``), then they agree on the furthest of
  those (``agreed_step``) and each goes on to it (a rank capped earlier waits inside its next
  step for the others, which are not capped below it).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from strategy.errors import RankFailedError


class StepGate:
    """Where a generation on a thread of its own stops between engine steps for a sync.

    The generating thread calls ``between_steps`` before each engine step; another thread
    calls ``hold(step)`` (returns once the generation stopped before that step, or ended) and
    then ``release()``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.steps = 0  # engine steps the running generation has done
        self._stop_at: int | None = None
        self._stopped = False
        self._running = False
        self.held = False  # the running generation stopped for a sync
        self.split: dict[str, int] | None = None  # then: each unfinished request's tokens
        # sampled before it (None: it stopped before its requests were in the engine)

    def start(self) -> None:
        """A new generation begins (a hold already made stays: it stops before its first
        step)."""
        with self._cond:
            self.steps, self._stopped, self._running = 0, False, True
            self.held, self.split = False, None

    def between_steps(self, sampled: Callable[[], dict[str, int] | None]) -> None:
        """The generating thread, before an engine step: stop here while held at this step
        (noting each request's tokens so far, ``sampled()``)."""
        with self._cond:
            while self._stop_at is not None and self.steps >= self._stop_at:
                if not self._stopped:
                    self.held, self.split, self._stopped = True, sampled(), True
                    self._cond.notify_all()
                self._cond.wait()  # released, or the stop moved on (another rank's cap)
            self._stopped = False
            self.steps += 1

    def end(self) -> None:
        """The generation ended (its thread, whatever the outcome)."""
        with self._cond:
            self._running = False
            self._cond.notify_all()

    def cap(self) -> int:
        """Stop the generation before the next engine step it would start; that step's
        number (the engine's ranks then agree on one, ``agreed_step``, and ``hold`` it)."""
        with self._cond:
            self._stop_at = self.steps if self._running else 0
            return self._stop_at

    def hold(self, step: int, timeout: float, what: str) -> bool:
        """Stop the generation before engine step ``step`` (the next one it starts, if it is
        past it): True once it stopped there, False if it ended first.

        Raises:
            RankFailedError: it neither stopped nor ended within ``timeout`` seconds.
        """
        with self._cond:
            self._stop_at = step
            self._cond.notify_all()  # stopped before a lower cap: on to this step
            if not self._cond.wait_for(lambda: self._stopped and self.steps >= step
                                       or not self._running, timeout):
                self._stop_at = None
                self._cond.notify_all()
                raise RankFailedError(f"the {what} did not stop for a sync within "
                                      f"--vllm_timeout={timeout:g} s")
            return self._stopped

    def release(self) -> None:
        """Let a held generation go on."""
        with self._cond:
            self._stop_at = None
            self._cond.notify_all()


def agreed_step(gate: StepGate, group) -> int:
    """The engine step every rank of one engine stops before: the furthest of their ``cap``s
    (collective on ``group``; None: an engine of one rank)."""
    step = torch.tensor([gate.cap()], dtype=torch.long)
    if group is not None:
        torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(step.item())
