"""Multi-turn chat rows into token ids through the tokenizer's chat template.

A row holds ``messages``: a list of ``{"role": "system"|"user"|"assistant", "content": str}``.
The whole conversation is rendered once; each assistant turn's tokens are found by rendering the
conversation up to that turn twice, with the generation prompt and with the turn, and taking the
difference. Labels cover the assistant content and its end-of-turn token (whatever the template
appends after the content up to and including its last special token); system and user turns,
role headers and the generation prompt are not scored.
"""

from __future__ import annotations

from typing import Any

from strategy.errors import DataError
from strategy.trainers.losses import IGNORE

ROLES = ("system", "user", "assistant", "tool")  # only assistant turns are scored


def check_messages(messages: Any, where: str) -> list[dict]:
    """A list of role/content dicts with at least one assistant turn, or a one-line error."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} dicts")
    for turn in messages:
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: a {role} turn has no text content; fix the row")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to learn; add one or drop the row")
    return messages


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    encoded = tokenizer.apply_chat_template(messages, tokenize=True,
                                            add_generation_prompt=generation_prompt)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _scored_span(tokens: list[int], special: set[int]) -> int:
    """How many of an assistant turn's tokens are scored: through its last special token (the
    end of turn), dropping separators the template puts after it; all when it has none."""
    last = max((i for i, token in enumerate(tokens) if token in special), default=len(tokens) - 1)
    return last + 1


def tokenize_chat(tokenizer: Any, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels are IGNORE outside assistant turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat_template; use a chat tokenizer or "
                        "rows with input/output fields")
    ids = _render(tokenizer, messages, generation_prompt=False)
    labels = [IGNORE] * len(ids)
    special = set(tokenizer.all_special_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], generation_prompt=True)
        through = _render(tokenizer, messages[: turn + 1], generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise DataError(f"{where}: the chat template does not render turns as prefixes of the "
                            "conversation, so assistant tokens cannot be located; use another "
                            "template")
        end = len(before) + _scored_span(through[len(before):], special)
        labels[len(before):end] = ids[len(before):end]
    return ids, labels


def as_messages(value: Any, role: str, where: str) -> list[dict]:
    """A turn list as it is, or a string as one turn of ``role`` (TRL's rows mix both)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise DataError(f"{where}: expected text or a list of {{role, content}} turns, got "
                    f"{type(value).__name__}; fix the row")


def tokenize_chat_response(tokenizer: Any, prompt: list[dict], response: list[dict],
                           where: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of ``prompt`` then ``response`` turns, only the response's assistant
    turns scored (TRL's prompt/completion and preference rows)."""
    messages = check_messages(prompt + response, where)
    if not any(turn["role"] == "assistant" for turn in response):
        raise DataError(f"{where}: the response has no assistant turn; fix the row")
    ids, labels = tokenize_chat(tokenizer, messages, where)
    start = len(_render(tokenizer, prompt, generation_prompt=True))
    return ids, [IGNORE] * start + labels[start:]


def split_conversations(chosen: list[dict], rejected: list[dict]) -> tuple[list, list, list]:
    """(shared prompt turns, chosen's rest, rejected's rest) of two conversations that share
    their beginning (preference rows without a separate prompt)."""
    shared = 0
    while (shared < min(len(chosen), len(rejected)) - 1
           and chosen[shared] == rejected[shared]):
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]
