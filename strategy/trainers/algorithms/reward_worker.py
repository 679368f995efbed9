"""A reward function's worker process (``--reward_timeout``), started by path so that it imports
nothing but the standard library and the reward's own module:

    python strategy/trainers/algorithms/reward_worker.py module:function

It prints ``["ready"]`` once the function is imported, then reads one JSON job per line
(``{"prompts", "completions", "rows"}``) and answers each call on its own line:
``["ok", first sample, [scores]]`` (one call per sample, or one for all when the function has
``batched = True``) or ``["error", -1, "Type: message"]``. The function's own prints go to
stderr, so they cannot break the protocol on stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def _value(v):
    """A score as JSON carries it (a tensor's item; anything else by its repr)."""
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    return v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)


def main(spec: str) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() inside the function lands on stderr
    sys.stdout = sys.stderr
    module_name, _, attr = spec.partition(":")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    batched = bool(getattr(fn, "batched", False))
    out.write(json.dumps(["ready"]) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        prompts, completions, rows = job["prompts"], job["completions"], job["rows"]
        try:
            if batched:
                out.write(json.dumps(["ok", 0, [_value(v) for v in fn(prompts, completions,
                                                                       rows)]]) + "\n")
                continue
            for i, args in enumerate(zip(prompts, completions, rows)):
                out.write(json.dumps(["ok", i, [_value(fn(*args))]]) + "\n")
        except Exception as exc:  # noqa: BLE001 - reported to the rank, which raises it
            out.write(json.dumps(["error", -1, f"{type(exc).__name__}: {exc}"]) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
