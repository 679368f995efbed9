"""The default run's toy task: reverse a short string of letters (learnable in ~2 minutes on CPU).
The hard variant (``--hard``: 7 to 12 letters, 512 held out) is the GRPO example's: a short SFT
run gets part of it right, and GRPO rewards the rest with ``exact_reward`` (1 for the right
answer) or ``reversal_reward`` (the share of letters in the right place).

python -m strategy.demos.toy_task make outputs/default/data  # SFT rows, preference pairs, tokenizer
python -m strategy.demos.toy_task make outputs/grpo/data --hard
python -m strategy.demos.toy_task evaluate outputs/default/model outputs/default/data/test.jsonl \
    [--compare outputs/default/answers.jsonl]                 # fresh-process reload + exact match
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

ALPHABET = "abcdefghij"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
ROLES = ["<system>", "<user>", "<assistant>"]
# each turn is its role token then its text; an assistant turn ends with <eos>
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_tokenizer(out_dir: str):
    """A character-level fast tokenizer with a small chat template: saveable, reloadable
    offline, no hub."""
    vocab = {token: i for i, token in enumerate(SPECIAL + list(ALPHABET) + ["="] + ROLES)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", additional_special_tokens=ROLES)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


LENGTHS = {False: (3, 6), True: (7, 12)}  # letters per word: default, hard


def sample(rng: random.Random, hard: bool = False) -> dict:
    word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*LENGTHS[hard])))
    return {"input": word + "=", "output": word[::-1]}


def reversal_reward(prompt: str, completion: str, row: dict) -> float:
    """GRPO reward: the share of positions where the completion has the right letter, over the
    longer of it and the answer (1.0 exactly for the right answer, less for extra letters)."""
    want = row["output"]
    hits = sum(a == b for a, b in zip(completion, want))
    return hits / max(len(completion), len(want))


def exact_reward(prompt: str, completion: str, row: dict) -> float:
    """GRPO reward: 1.0 for the right answer, else 0.0."""
    return float(completion == row["output"])


def to_pair(row: dict, rng: random.Random) -> dict:
    """A preference pair: the reversal is chosen over the same letters in another order."""
    letters = list(row["output"])
    while "".join(letters) == row["output"] and len(set(letters)) > 1:
        rng.shuffle(letters)
    return {"prompt": row["input"], "chosen": row["output"], "rejected": "".join(letters) + "a"}


def to_chat(rows: list[dict]) -> dict:
    """A conversation asking for each row's reversal in turn, under a system instruction."""
    messages = [{"role": "system", "content": "="}]
    for row in rows:
        messages += [{"role": "user", "content": row["input"]},
                     {"role": "assistant", "content": row["output"]}]
    return {"messages": messages}


def make(out_dir: str, n_train: int = 8192, n_test: int | None = None, seed: int = 0,
         hard: bool = False) -> None:
    n_test = n_test or (512 if hard else 128)  # the hard set is GRPO's yardstick: less noise
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    test = {}
    while len(test) < n_test:  # held-out words never appear in training
        row = sample(rng, hard)
        test[row["input"]] = row
    train = []
    while len(train) < n_train:
        row = sample(rng, hard)
        if row["input"] not in test:
            train.append(row)
    pairs = [to_pair(r, rng) for r in train[:2048]]
    held_pairs = [to_pair(r, rng) for r in test.values()]
    chats = [to_chat(train[i:i + 2]) for i in range(0, min(len(train), 2048), 2)]
    files = (("train", train), ("test", list(test.values())), ("pairs_train", pairs),
             ("pairs_test", held_pairs), ("chat_train", chats))
    for name, rows in files:
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    make_tokenizer(os.path.join(out_dir, "tokenizer"))
    print(f"wrote {len(train)} train / {len(test)} held-out rows and a char tokenizer to {out_dir}")


def generate(model, tokenizer, prompts: list[str], synced_gpus: bool = False) -> list[str]:
    """Greedy answers, one prompt at a time (no padding effects)."""
    answers = []
    for prompt in prompts:
        encoded = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
        ids = encoded["input_ids"].to(model.device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, synced_gpus=synced_gpus)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def evaluate(model_dir: str, data: str, compare: str | None) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in open(data)]
    answers = generate(model, tokenizer, [r["input"] for r in rows])
    acc = sum(a == r["output"] for a, r in zip(answers, rows)) / len(rows)
    for r, a in list(zip(rows, answers))[:5]:
        print(f"  {r['input']:<8} -> {a:<8} (want {r['output']})")
    print(f"held-out exact-match accuracy: {acc:.1%} ({len(rows)} samples, fresh-process reload "
          f"of {model_dir})")
    if compare:
        before = [json.loads(line)["answer"] for line in open(compare)]
        same = sum(a == b for a, b in zip(answers, before))
        print(f"reloaded model agrees with the in-training model on {same}/{len(rows)} answers")
        if same != len(rows):
            raise SystemExit("the exported model answers differently from the model in training")
    return acc


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="cmd", required=True)
    make_cmd = commands.add_parser("make")
    make_cmd.add_argument("out_dir")
    make_cmd.add_argument("--hard", action="store_true", help="7-12 letters (the GRPO example)")
    make_cmd.add_argument("--n_test", type=int, default=None, help="held-out rows (128; 512 hard)")
    evaluate_cmd = commands.add_parser("evaluate")
    evaluate_cmd.add_argument("model_dir")
    evaluate_cmd.add_argument("data")
    evaluate_cmd.add_argument("--compare", default=None)
    evaluate_cmd.add_argument("--min_accuracy", type=float, default=0.0)
    args = parser.parse_args()
    if args.cmd == "make":
        make(args.out_dir, n_test=args.n_test, hard=args.hard)
    elif evaluate(args.model_dir, args.data, args.compare) < args.min_accuracy:
        raise SystemExit(f"accuracy below --min_accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()
