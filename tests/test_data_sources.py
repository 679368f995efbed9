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


def _stream(path: str, tok, rank: int, world: int, **cfg):
    from strategy.trainers.data.files import sft_parts, sft_sample
    from strategy.trainers.data.stream import TokenStream, open_stream

    config = DataConfig(dataset=path, streaming=True, max_len=16, **cfg)
    rows = open_stream(path, "train", config)
    return TokenStream(rows, sft_parts(tok, config), sft_sample, config, path, rank, world, 7)


def test_a_stream_deals_each_pass_to_ranks_and_resumes_exactly(tmp_path, tok):
    from itertools import islice

    words = ["".join(p) for p in __import__("itertools").permutations("abcdefg", 3)][:21]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"input": w + "=", "output": w[::-1]}) + "\n"
                            for w in words))
    everything = {tuple(s["input_ids"]) for s in ds.load_sft(str(path), tok, DataConfig())}

    def ids(rank: int, world: int, n: int) -> list[tuple]:
        stream = _stream(str(path), tok, rank, world, shuffle_buffer=8)
        return [tuple(s["input_ids"]) for s in islice(stream, n)]

    alone = ids(0, 1, 42)
    assert sorted(alone[:21]) == sorted(alone[21:]) and set(alone[:21]) == everything
    assert alone[:21] != alone[21:]  # one pass is every row once; the next is reshuffled
    rank0, rank1 = ids(0, 2, 11), ids(1, 2, 10)  # a pass dealt to 2 ranks: 11 + 10 rows
    assert set(rank0).isdisjoint(rank1) and set(rank0) | set(rank1) == everything
    whole = list(islice(_stream(str(path), tok, 1, 2), 30))
    resumed = _stream(str(path), tok, 1, 2)
    resumed.resume_at(13)
    assert list(islice(resumed, 17)) == whole[13:]  # exactly where it stopped, across a pass


def streamed_sft(root: str, name: str, **extra) -> list[dict]:
    from strategy.trainers import Run, SFTTrainer

    flags = {"zero_stage": 2, "micro_train_batch_size": 2, "train_batch_size": 8,
             "learning_rate": 1e-3, "max_len": 16, "max_steps": 8, "save_steps": 4,
             "logging_steps": 1, "streaming": True, "shuffle_buffer": 16,
             "tokenizer": f"{root}/tok", "model_config": "configs/tiny_llama.json",
             "dataset": f"{root}/train.jsonl", "save_path": f"{root}/{name}/model",
             "ckpt_path": f"{root}/{name}/ckpt", "log_dir": f"{root}/{name}/logs", **extra}
    argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in flags.items()]
    with Run.from_args(argv) as run:
        trainer = run.trainer(SFTTrainer, run.model())
        trainer.fit()
    return trainer.history


def test_streamed_training_resumes_exactly_at_two_ranks(ranks, tmp_path, tok):
    import shutil

    tok.save_pretrained(tmp_path / "tok")
    rows = [{"input": w + "=", "output": w[::-1]} for w in
            ("abc", "bcad", "cdeab", "defg", "efghi", "fgh", "ghij", "hij", "ijab", "jab",
             "abcd", "bcde", "cdef", "defgh", "efg", "fghij", "gha", "hia", "iab")]  # 19: odd
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = ranks.run(streamed_sft, str(tmp_path), "full")[0]
    assert [r["step"] for r in full] == list(range(1, 9))  # 8 steps of 8: past a pass of 19
    ckpt = tmp_path / "full" / "ckpt"
    shutil.rmtree(ckpt / "global_step8")
    (ckpt / "latest").write_text("global_step4")
    resumed = ranks.run(streamed_sft, str(tmp_path), "full", load_checkpoint=True)[0]
    keys = ("step", "loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys}
                                                         for r in full[4:]]
