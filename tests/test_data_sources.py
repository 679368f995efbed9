"""Datasets as users bring them (issue 20): what ``datasets`` loads (files, globs, CSV, a local
folder laid out as a Hub dataset repository, ``save_to_disk`` folders), splits, seeded mixing,
``--input_template``, and TRL's prompt/completion and conversational preference rows. Single
process, offline (tests/conftest.py sets the offline switches)."""

from __future__ import annotations

import json

import datasets
import pytest

from strategy.errors import ConfigError, DataError
from strategy.trainers import data as ds
from strategy.trainers.config import DataConfig
from strategy.trainers.losses import IGNORE


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.support.tokenizers import checkpoint_like_tokenizer

    tokenizer = checkpoint_like_tokenizer(str(tmp_path_factory.mktemp("tok")))
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


ROWS = [{"input": w + "=", "output": w[::-1]} for w in ("abc", "dea", "fgh", "ija", "bbc")]


def _hub_repo(root, train: list[dict], test: list[dict]) -> str:
    """A folder laid out as a Hub dataset repository: data/<split>-00000-of-00001.parquet."""
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: mit\n---\n")
    for split, rows in (("train", train), ("test", test)):
        datasets.Dataset.from_list(rows).to_parquet(
            str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return str(root)


def test_a_hub_layout_folder_and_its_splits(tmp_path, tok):
    repo = _hub_repo(tmp_path / "repo", ROWS[:4], ROWS[4:])
    cfg = DataConfig(max_len=16)
    assert len(ds.load_sft(repo, tok, cfg, split="train")) == 4
    assert len(ds.load_sft(repo, tok, cfg, split="test")) == 1
    with pytest.raises(DataError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        ds.load_sft(repo, tok, cfg, split="validation")


def test_save_to_disk_folders_globs_and_csv(tmp_path, tok):
    cfg = DataConfig(max_len=16)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                          "eval": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(
        str(tmp_path / "saved"))
    assert len(ds.load_sft(str(tmp_path / "saved"), tok, cfg, split="eval")) == 2
    datasets.DatasetDict({"eval": datasets.Dataset.from_list(
        [ROWS[0], {"input": "ab=", "output": None}])}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"bad \[eval\] row 1: missing key 'output'"):
        ds.load_sft(str(tmp_path / "bad"), tok, cfg, split="eval")  # file, split, row, key
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert len(ds.load_sft(str(tmp_path / "one"), tok, cfg)) == 5
    for i, row in enumerate(ROWS):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps(row) + "\n")
    assert len(ds.load_sft(str(tmp_path / "part*.jsonl"), tok, cfg)) == 5
    with pytest.raises(DataError, match="no such file, folder or matching pattern"):
        ds.load_sft(str(tmp_path / "nothing*.jsonl"), tok, cfg)
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "rows.csv"))
    samples = ds.load_sft(str(tmp_path / "rows.csv"), tok, cfg)
    assert samples == ds.load_sft(str(tmp_path / "part*.jsonl"), tok, cfg)  # same rows, same ids


def test_mixing_is_seeded_and_uses_every_row(tmp_path, tok):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    b.write_text("".join(json.dumps({"input": "j=", "output": "j"}) + "\n" for _ in range(2)))
    cfg = DataConfig(dataset=f"{a},{b}", dataset_probs="0.7,0.3")
    mixed = ds.read_rows(cfg.dataset, probabilities=cfg.probabilities())
    assert mixed == ds.read_rows(cfg.dataset, probabilities=cfg.probabilities())  # seeded
    assert all(row in mixed for row in ROWS[:4]) and {"input": "j=", "output": "j"} in mixed
    assert ds.read_rows(f"{a},{b}") == ROWS[:4] + [{"input": "j=", "output": "j"}] * 2
    with pytest.raises(ConfigError, match="one positive weight for each of the 2 datasets"):
        DataConfig(dataset=f"{a},{b}", dataset_probs="1")


def test_input_template_wraps_prompts(tok):
    cfg = DataConfig(input_template=r"User: {}\nAssistant: ")
    assert ds.files.Tokenize(tok, cfg).prompt("abc=") == "User: abc=\nAssistant: "
    with pytest.raises(ConfigError, match="put {} where the prompt goes"):
        DataConfig(input_template="User:")


def _scored(sample: dict, key: str = "labels") -> list[int]:
    return [t for t in sample[key] if t != IGNORE]


def test_trl_prompt_completion_rows(tmp_path, tok):
    path = tmp_path / "trl.jsonl"
    turns = [{"role": "user", "content": "ab="}, {"role": "assistant", "content": "ba"},
             {"role": "user", "content": "cd="}]
    rows = [{"prompt": "ab=", "completion": "ba"},
            {"prompt": turns, "completion": [{"role": "assistant", "content": "dc"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, chat = ds.load_sft(str(path), tok, DataConfig(max_len=64))
    ids = tok.convert_tokens_to_ids
    assert _scored(plain) == ids(["b", "a"]) + [tok.eos_token_id]
    assert _scored(chat) == ids(["d", "c", "<|im_end|>"])  # the completion only, not "ba"


def test_conversational_preference_rows(tmp_path, tok):
    ask = [{"role": "user", "content": "ab="}]
    rows = [{"chosen": ask + [{"role": "assistant", "content": "ba"}],
             "rejected": ask + [{"role": "assistant", "content": "ab"}]},  # prompt shared
            {"prompt": ask, "chosen": [{"role": "assistant", "content": "ba"}],
             "rejected": [{"role": "assistant", "content": "ab"}]},
            {"prompt": "ab=", "chosen": [{"role": "assistant", "content": "ba"}],
             "rejected": [{"role": "assistant", "content": "ab"}]}]
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = ds.load_pairs(str(path), tok, DataConfig(max_len=64))
    assert pairs[0] == pairs[1] == pairs[2]  # three layouts, one sample
    ids = tok.convert_tokens_to_ids
    assert _scored(pairs[0], "chosen_labels") == ids(["b", "a", "<|im_end|>"])
    assert _scored(pairs[0], "rejected_labels") == ids(["a", "b", "<|im_end|>"])
    prompt = len(pairs[0]["chosen_ids"]) - 3
    assert pairs[0]["chosen_ids"][:prompt] == pairs[0]["rejected_ids"][:prompt]
