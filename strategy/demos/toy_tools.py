"""The tool-use example's task: multiply two numbers of 3 or 4 digits, with a calculator the model
may call (``multiply``, the ``--tools`` list here). A tiny model cannot multiply in its head; it
can learn to call the tool and copy its answer.

python -m strategy.demos.toy_tools make outputs/tools/data
python -m strategy.demos.toy_tools evaluate outputs/tools/model outputs/tools/data/test.jsonl \
    [--no_tools]      # greedy episodes, one process, fresh reload: held-out exact match

Rows ``{"input": "123*456=", "output": "56088"}`` (train, test), and SFT conversations: with the
tool (``tool_sft.jsonl``: a Hermes-style ``<tool_call>`` turn, the tool's turn, the answer) and
without (``direct_sft.jsonl``: the answer at once). The tokenizer is character-level over
printable ASCII, with the JSON of a call's frame as whole tokens, role tokens, and a chat template
that renders ``tools`` as a ``<system>`` line (``multiply(a, b)``) and a tool's result as a
``<tool>`` turn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import types
from functools import partial

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from strategy import dist
from strategy.tools import ToolAgent, tool_schemas
from strategy.trainers.algorithms.completions import left_padded, until_eos
from strategy.trainers.algorithms.episodes import EpisodeRunner

SPECIAL = ["<pad>", "<eos>", "<unk>"]
ROLES = ["<system>", "<user>", "<assistant>", "<tool>"]
PIECES = ["<tool_call>", "</tool_call>", '{"name": "', '", "arguments": {', '"a": ', ', "b": ',
          "}}"]  # a call's frame: one token each
CHAT_TEMPLATE = (
    "{%- if tools %}<system>{% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(', ') }}){% endfor %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<assistant>{{ m.content }}<eos>"
    "{%- else %}<{{ m.role }}>{{ m.content }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


TOOLS = [multiply]


def make_tokenizer(out_dir: str | None = None) -> PreTrainedTokenizerFast:
    """The task's tokenizer (saved in ``out_dir`` when given): offline, no hub."""
    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIAL + ROLES + PIECES + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    pattern = "|".join(re.escape(p) for p in PIECES) + "|."
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", additional_special_tokens=ROLES)
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


def tool_call(a: int, b: int) -> str:
    """The Hermes-style call of ``multiply(a, b)``, as the model is taught to write it."""
    return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def sample(rng: random.Random) -> tuple[int, int]:
    return rng.randint(100, 9999), rng.randint(100, 9999)


def row(a: int, b: int) -> dict:
    return {"input": f"{a}*{b}=", "output": str(a * b)}


def with_tool(a: int, b: int) -> dict:
    """A conversation that calls the tool, then answers with its result."""
    return {"messages": [{"role": "system", "content": "multiply(a, b)"},
                         {"role": "user", "content": f"{a}*{b}="},
                         {"role": "assistant", "content": tool_call(a, b)},
                         {"role": "tool", "content": str(a * b)},
                         {"role": "assistant", "content": str(a * b)}]}


def direct(a: int, b: int) -> dict:
    """A conversation that answers at once (no tool)."""
    return {"messages": [{"role": "user", "content": f"{a}*{b}="},
                         {"role": "assistant", "content": str(a * b)}]}


def exact_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 for the product, else 0.0."""
    return float(completion.strip() == row["output"])


def make(out_dir: str, n_train: int = 4096, n_test: int = 256, seed: int = 0) -> None:
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    test = {}
    while len(test) < n_test:
        pair = sample(rng)
        test[pair] = row(*pair)
    train = []
    while len(train) < n_train:
        pair = sample(rng)
        if pair not in test:
            train.append(pair)
    files = {"train": [row(*p) for p in train], "test": list(test.values()),
             "tool_sft": [with_tool(*p) for p in train], "direct_sft": [direct(*p) for p in train]}
    for name, rows in files.items():
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    make_tokenizer(os.path.join(out_dir, "tokenizer"))
    print(f"wrote {n_train} train / {n_test} held-out products and a tokenizer to {out_dir}")


def evaluate(model_dir: str, data: str, tools: bool = True, max_turns: int = 3,
             max_new_tokens: int = 32, max_len: int = 112) -> float:
    """Held-out exact match of greedy episodes (the answer: the last model turn), the tool run
    by ``strategy.tools.ToolAgent`` as in training; ``tools=False``: the prompt without the
    tool's line, one turn."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in open(data)]
    schemas = tool_schemas(TOOLS) if tools else None
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["input"]}], tokenize=False,
                                       add_generation_prompt=True, tools=schemas) for r in rows]

    def generate(contexts: list[list[int]], max_new: int):
        ids, mask = left_padded(contexts, tok.pad_token_id)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        return until_eos(out[:, ids.shape[1]:], tok.eos_token_id), None

    solo = types.SimpleNamespace(checked=dist.checked, all_reduce=dist.all_reduce,
                                 all_gather_object=dist.all_gather_object)
    agent = partial(ToolAgent, TOOLS, tool_schemas(TOOLS), tok, 10.0)
    runner = EpisodeRunner(agent, "tools", tok,
                           max_turns if tools else 1, max_new_tokens, max_len, 60.0, solo)
    hits, calls = 0, 0
    for start in range(0, len(rows), 64):
        part = slice(start, start + 64)
        episodes = runner.run(prompts[part], [tok(p, add_special_tokens=False)["input_ids"]
                                              for p in prompts[part]], rows[part], "output",
                              generate)
        for e, r in zip(episodes, rows[part]):
            answer = tok.decode(e.last_turn(), skip_special_tokens=True).strip()
            hits += answer == r["output"]
            calls += e.logs.get("tool_calls", 0)
    acc = hits / len(rows)
    print(f"held-out exact match: {acc:.1%} ({len(rows)} products, {'with' if tools else 'no'} "
          f"tool, {calls / len(rows):.2f} calls per episode; fresh reload of {model_dir})")
    return acc


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="cmd", required=True)
    make_cmd = commands.add_parser("make")
    make_cmd.add_argument("out_dir")
    make_cmd.add_argument("--n_train", type=int, default=4096)
    make_cmd.add_argument("--n_test", type=int, default=256)
    evaluate_cmd = commands.add_parser("evaluate")
    evaluate_cmd.add_argument("model_dir")
    evaluate_cmd.add_argument("data")
    evaluate_cmd.add_argument("--no_tools", action="store_true", help="no tool line, one turn")
    args = parser.parse_args()
    if args.cmd == "make":
        make(args.out_dir, args.n_train, args.n_test)
    else:
        evaluate(args.model_dir, args.data, tools=not args.no_tools)


if __name__ == "__main__":
    main()
