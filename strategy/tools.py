"""Tool calls through chat templates (``--tools module:name``, GRPO and PPO).

``module:name`` names a list of Python functions (or one), each with type hints and a docstring
whose ``Args:`` describe its parameters, as ``transformers.utils.get_json_schema`` reads them.
Their schemas reach the model through the chat template (``apply_chat_template(tools=...)`` on
every prompt; ``--apply_chat_template``). An episode then runs on the built-in environment
``ToolAgent``, through the same batched turns as an agent file's:

- the model's turn is parsed for tool calls: with the tokenizer's ``response_template``
  (``tokenizer.parse_response``) when it has one, else the Hermes form Qwen, Hermes and many
  others emit, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- each call runs with ``--tool_timeout`` seconds (on a thread; one that does not return is left
  behind); its result, or ``error: ...`` for a call that raised, timed out, named no tool or
  did not parse, is appended as the template's tool turn (the text the template puts between
  the assistant's end-of-turn token and the next assistant turn, with the generation prompt);
- a turn without a call is the answer: the episode ends and ``--reward_fn`` scores that turn
  (the row and prompt as for one completion); the turns before carry no reward.

Tool turns are feedback: context only, no loss.
"""

from __future__ import annotations

import importlib
import json
import re
import threading
from typing import Any, Callable

from transformers.utils import get_json_schema

from strategy.agents import AgentInstanceBase
from strategy.errors import ConfigError, fail

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def load_tools(spec: str) -> list[Callable]:
    """The functions ``module:name`` names (a list, a tuple or one callable), each with a JSON
    schema (``tool_schemas``); one line naming the spec and the fix otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        fail("tools", spec, "write it as module:name, naming a list of functions")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fail("tools", spec, f"cannot import {module_name!r} ({exc}); put it on PYTHONPATH")
    value = getattr(module, attr, None)
    tools = [value] if callable(value) else list(value) if isinstance(value, (list, tuple)) \
        else None
    if not tools or not all(callable(t) for t in tools):
        fail("tools", spec, f"{module_name}.{attr} is not a function or a list of functions")
    names = [t.__name__ for t in tools]
    if len(set(names)) != len(names):
        fail("tools", spec, f"two tools share a name ({', '.join(names)}); rename one")
    tool_schemas(tools, spec)
    return tools


def tool_schemas(tools: list[Callable], spec: str = "") -> list[dict]:
    """Each tool's JSON schema (``get_json_schema``), as ``apply_chat_template`` takes them."""
    out = []
    for tool in tools:
        try:
            out.append(get_json_schema(tool))
        except Exception as exc:  # noqa: BLE001 - transformers' DocstringParsingException...
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            fail("tools", spec, f"{tool.__name__} has no JSON schema ({first}); give it type "
                 "hints and a docstring with Args:")
    return out


def parse_tool_calls(tokenizer: Any, text: str, prefix: str = "",
                     schemas: list[dict] | None = None) -> list[dict]:
    """The calls in a model turn, each ``{"name", "arguments"}`` or ``{"error": why}``."""
    if getattr(tokenizer, "response_template", None) is not None:
        message = tokenizer.parse_response(text, prefix=prefix, tools=schemas)
        calls = message.get("tool_calls") or []
        return [{"name": c.get("function", c).get("name"),
                 "arguments": c.get("function", c).get("arguments") or {}} for c in calls]
    out = []
    for body in HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            out.append({"error": f"the tool call is not JSON ({exc.msg})"})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append({"error": "the tool call names no tool"})
            continue
        arguments = call.get("arguments") or {}
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append({"name": call["name"], "arguments": arguments})
    return out


def run_tool(tools: dict[str, Callable], call: dict, timeout: float) -> tuple[str, str, bool]:
    """``(tool name, result text, ok)`` of one parsed call, at most ``timeout`` seconds."""
    name = call.get("name") or "?"
    if "error" in call:
        return name, f"error: {call['error']}", False
    if name not in tools:
        return name, f"error: no tool named {name!r}; the tools are {', '.join(tools)}", False
    if not isinstance(call["arguments"], dict):
        return name, "error: the arguments are not an object", False
    out: list[tuple[str, bool]] = []

    def run() -> None:
        try:
            out.append((str(tools[name](**call["arguments"])), True))
        except Exception as exc:  # noqa: BLE001 - the model's call: its error is its feedback
            out.append((f"error: {type(exc).__name__}: {exc}", False))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout or None)
    if not out:
        return name, f"error: {name} did not return within {timeout:g} s", False
    return name, *out[0]


def tool_turn(tokenizer: Any, results: list[tuple[str, str]]) -> str:
    """The text the chat template puts after an assistant turn that ended at its end-of-turn
    token for these tool results, through the next assistant turn's opening (the template's
    separator after that token first: the model stopped at the token)."""
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    turns = [{"role": "tool", "name": name, "content": content} for name, content in results]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + turns, tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise ConfigError("tools is invalid for this tokenizer: its chat template does not "
                          "render a tool turn as a continuation of the conversation; use a "
                          "template with a tool role")
    if not all(content in after[len(before):] for _, content in results):
        raise ConfigError("tools is invalid for this tokenizer: its chat template drops tool "
                          "turns (no tool role); use a template that renders them")
    tail, eos = before[before.rindex("!") + 1:], tokenizer.eos_token or ""
    separator = tail[tail.index(eos) + len(eos):] if eos and eos in tail else ""
    return separator + after[len(before):]


class ToolAgent(AgentInstanceBase):
    """The environment of ``--tools``: runs the calls of each model turn, ends the episode at a
    turn without one (the trainer's reward then scores it).

    Args:
        tools: the functions (``load_tools``).
        schemas: their schemas (``tool_schemas``: made once, not per episode).
        tokenizer: parses turns and renders tool turns with its chat template.
        timeout: seconds one call may take.
    """

    def __init__(self, tools: list[Callable], schemas: list[dict], tokenizer: Any,
                 timeout: float) -> None:
        self.tools = {t.__name__: t for t in tools}
        self.schemas, self.tokenizer, self.timeout = schemas, tokenizer, timeout
        self.calls = self.errors = 0  # the episode's, logged as agent_tool_calls / _errors

    def step(self, states: dict) -> dict:
        calls = parse_tool_calls(self.tokenizer, states["action_text"],
                                 states["observation_text"], self.schemas)
        results = [run_tool(self.tools, call, self.timeout) for call in calls]
        self.calls += len(results)
        self.errors += sum(not ok for *_, ok in results)
        logs = {"tool_calls": self.calls, "tool_errors": self.errors}
        if not results:
            return {"rewards": 0.0, "done": True, "environment_feedback": "", "extra_logs": logs}
        return {"rewards": 0.0, "done": False, "extra_logs": logs,
                "environment_feedback": tool_turn(self.tokenizer, [r[:2] for r in results])}
