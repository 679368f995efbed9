"""Environments for multi-turn rollouts, written as OpenRLHF's agent files are.

``--agent_func_path FILE`` (GRPO, PPO) names a Python file defining ``AgentInstance``, a subclass
of ``AgentInstanceBase`` (or, as OpenRLHF's examples do, ``AgentExecutor``, a
``MultiTurnAgentExecutor`` made with it). A file written for OpenRLHF runs here unchanged: where
OpenRLHF is not installed, its ``from openrlhf.utils.agent import AgentInstanceBase,
MultiTurnAgentExecutor`` resolves to this module while the file loads (nothing else of
``openrlhf`` does; ``from strategy.agents import ...`` works too).

One instance per episode, made with no arguments. Its methods may be ``async def`` or ``def``:

- ``reset(states)``: ``states`` holds ``observation`` (the prompt, chat template applied) and
  ``label`` (the row's ``--output_key`` value; ``row``: the whole row). Returns
  ``{"observation": text}``: the episode's first context.
- ``step(states)``: ``states`` holds ``observation_text`` (the context so far), ``action_text``
  (the model's last turn, special tokens dropped), ``label``, ``row`` and ``turn``. Returns
  ``rewards`` (this turn's reward: a number or a one-element tensor), ``environment_feedback``
  (text appended as context: no loss on it), ``done``, and optionally ``scores``
  (``--dynamic_filtering`` reads them; default the episode's reward so far) and ``extra_logs``.
  ``states["sampling_params"]`` holds the configured sampling (``temperature``, ``top_p``,
  ``top_k``); a step may return it as ``sampling_params`` (OpenRLHF's examples hand it back),
  or None. Other values are refused in one line, never dropped: the loss's log-probs are those
  of the configured sampling.

An episode ends when ``step`` says ``done``, after ``--max_turns`` model turns, or when its
context reaches ``--max_len`` (feedback is cut to fit). Its reward is the sum of its turns'
(OpenRLHF's ``total_reward``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from abc import ABC, abstractmethod
from typing import Any, Iterator

from strategy.errors import fail

OPENRLHF_AGENT = "openrlhf.utils.agent"  # the module OpenRLHF's agent files import from


class AgentInstanceBase(ABC):
    """One episode's environment (OpenRLHF's ``AgentInstanceBase``): ``reset``, then ``step``
    after each model turn."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027 - optional, as OpenRLHF's
        """An episode's environment, made with no arguments."""

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """The episode's first context: ``{"observation": text}`` (default: the prompt)."""
        return {"observation": states["observation"]}

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        """The environment's answer to the model's turn (see the module's docstring)."""


class MultiTurnAgentExecutor:
    """Names an agent file's ``AgentInstance`` class (OpenRLHF's ``AgentExecutor`` subclasses
    this with ``super().__init__(AgentInstance)``); episodes run in the trainer."""

    def __init__(self, agent_instance_cls: type) -> None:
        if not (isinstance(agent_instance_cls, type)
                and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"{agent_instance_cls!r} is not a subclass of AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls


def load_agent(path: str) -> type:
    """The environment class an agent file defines: ``AgentExecutor().agent_instance_cls`` when
    it has one, else ``AgentInstance``; one line naming the file and the fix otherwise.

    Args:
        path: the ``--agent_func_path`` file.

    Returns:
        The class, made once per episode.
    """
    if not path.endswith(".py") or not os.path.isfile(path):
        fail("agent_func_path", path, "give an existing Python file defining class "
             "AgentInstance(AgentInstanceBase)")
    spec = importlib.util.spec_from_file_location(f"strategy_agent_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        with _openrlhf_agent_names():
            spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        hint = (f"; OpenRLHF is not installed here: of it only {OPENRLHF_AGENT}'s "
                "AgentInstanceBase and MultiTurnAgentExecutor resolve (to strategy.agents)"
                if (exc.name or "").startswith("openrlhf") else "")
        fail("agent_func_path", path, f"importing it failed: {exc}{hint}")
    except Exception as exc:  # noqa: BLE001 - the user's file: one line whatever it raised
        fail("agent_func_path", path, f"importing it failed: {type(exc).__name__}: {exc}")
    cls = _agent_class(module, path)
    if not callable(getattr(cls, "step", None)):
        fail("agent_func_path", path, f"{cls.__name__} has no step(states) method")
    return cls


@contextlib.contextmanager
def _openrlhf_agent_names() -> Iterator[None]:
    """While an agent file loads where OpenRLHF is not installed: ``openrlhf.utils.agent`` is
    this module (its parents empty packages), removed again after."""
    if importlib.util.find_spec("openrlhf") is not None:
        yield
        return
    names = ("openrlhf", "openrlhf.utils")
    saved = {name: sys.modules.get(name) for name in (*names, OPENRLHF_AGENT)}
    for name in names:
        package = types.ModuleType(name)
        package.__path__ = []  # a package: its other modules are not found
        sys.modules[name] = package
    sys.modules["openrlhf"].utils = sys.modules["openrlhf.utils"]
    sys.modules["openrlhf.utils"].agent = sys.modules[OPENRLHF_AGENT] = sys.modules[__name__]
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _agent_class(module: Any, path: str) -> type:
    executor = getattr(module, "AgentExecutor", None)
    if isinstance(executor, type) and issubclass(executor, MultiTurnAgentExecutor):
        try:
            return executor().agent_instance_cls
        except Exception as exc:  # noqa: BLE001 - the user's class
            fail("agent_func_path", path, f"AgentExecutor() failed: {type(exc).__name__}: {exc}")
    cls = getattr(module, "AgentInstance", None)
    if not isinstance(cls, type):
        fail("agent_func_path", path, "it defines no class AgentInstance (nor AgentExecutor); "
             "define class AgentInstance(AgentInstanceBase) with reset and step")
    return cls
