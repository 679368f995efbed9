"""Single-process checks of the trainers' math and data handling on hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from strategy.trainers import data as ds
from strategy.trainers.algorithms.dpo import dpo_loss
from strategy.trainers.algorithms.rm import pairwise_metrics
from strategy.trainers.algorithms.sft import response_loss
from strategy.trainers.config import DataConfig


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from strategy.demos.toy_task import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_dpo_loss_matches_direct_computation():
    pc, pr = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.5, -2.0])
    rc, rr = torch.tensor([-3.5, -5.0, -1.0]), torch.tensor([-3.5, -5.0, -3.0])
    beta, ls = 0.5, 0.1
    loss, m = dpo_loss(pc, pr, rc, rr, beta, ls)
    expected, acc, margins = 0.0, 0, []
    for i in range(3):
        z = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        expected += (
            -(1 - ls) * math.log(1 / (1 + math.exp(-z))) - ls * math.log(1 / (1 + math.exp(z)))
        ) / 3
        c, r = beta * (pc[i] - rc[i]).item(), beta * (pr[i] - rr[i]).item()
        acc += c > r
        margins.append(c - r)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["reward_accuracy"] == pytest.approx(acc / 3) and acc == 1  # only row 0 prefers chosen
    assert m["reward_margin"] == pytest.approx(sum(margins) / 3, rel=1e-6)


def test_pairwise_rm_metrics():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0, 3.0]), torch.tensor([1.0, 0.5, -2.0, 3.0])
    loss, m = pairwise_metrics(chosen, rejected)
    direct = (
        sum(
            -math.log(1 / (1 + math.exp(-(c - r))))
            for c, r in zip(chosen.tolist(), rejected.tolist())
        )
        / 4
    )
    assert loss.item() == pytest.approx(direct, rel=1e-6)
    assert m["accuracy"] == 0.5 and m["reward_margin"] == pytest.approx(
        0.375
    )  # ties do not count as wins


def test_response_loss_counts_only_response_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 1, 2, 6, 5]])
    loss, n = response_loss(logits, labels)
    terms = [
        F.cross_entropy(logits[b, t - 1][None], labels[b, t][None])
        for b in range(2)
        for t in range(1, 5)
        if labels[b, t] != -100
    ]
    assert n == 6 == len(terms) and loss.item() == pytest.approx(
        torch.stack(terms).mean().item(), rel=1e-6
    )


def _write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_masking_and_collate(tmp_path, tok):
    path = _write(tmp_path, [{"input": "abc=", "output": "cba"}, {"input": "ab=", "output": "ba"}])
    rows = ds.load_sft(path, tok, DataConfig(max_len=16))
    batch = ds.collate_sft(tok.pad_token_id)(rows)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert batch["input_ids"][1].tolist() == tok("ab=ba", add_special_tokens=False)["input_ids"] + [
        eos,
        pad,
        pad,
    ]
    response = tok("ba", add_special_tokens=False)["input_ids"]
    assert batch["labels"][1].tolist() == [-100] * 3 + response + [eos, -100, -100]
    assert batch["attention_mask"][1].tolist() == [1] * 6 + [0, 0]


BAD_ROWS = [
    ([{"output": "x"}], {}, "row 0: missing key 'input'"),
    (
        [{"input": "ab=", "output": "ba"}, {"input": "a=", "output": "  "}],
        {},
        "row 1: 'output' is empty",
    ),
    ([{"input": "ab=", "output": 5}], {}, "row 0: 'output' is empty or not text"),
    (
        [{"input": "abcdefghij=", "output": "jihgfedcba"}],
        {"overlong": "error", "max_len": 8},
        "row 0: 14 tokens over max_len=8",
    ),
    ([{"q": "ab=", "output": "ba"}], {"input_key": "question"}, "missing key 'question'"),
]


@pytest.mark.parametrize("rows,cfg,message", BAD_ROWS, ids=[str(i) for i in range(len(BAD_ROWS))])
def test_bad_rows_name_file_and_row(tmp_path, tok, rows, cfg, message):
    path = _write(tmp_path, rows)
    with pytest.raises(ds.DataError) as err:
        ds.load_sft(path, tok, DataConfig(**cfg))
    assert message in str(err.value) and path in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path, tok):
    with pytest.raises(ds.DataError, match="no such file"):
        ds.load_sft(str(tmp_path / "nope.jsonl"), tok, DataConfig())
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ds.DataError, match="cannot be read as json"):
        ds.load_sft(str(bad), tok, DataConfig())
    with pytest.raises(ds.DataError, match="unknown extension '.txt'"):
        ds.load_sft(_write(tmp_path, [], "d.txt"), tok, DataConfig())


def test_skips_and_overlong_policies_are_counted(tmp_path, tok, capsys):
    rows = [
        {"input": "ab=", "output": "ba"},
        {"input": "ab="},
        {"input": "abcdefghij=", "output": "jihgfedcba"},
    ]
    path = _write(tmp_path, rows)
    kept = ds.load_sft(path, tok, DataConfig(skip_bad_rows=True, max_len=8, overlong="drop"))
    assert (
        len(kept) == 1 and "dropped over max_len 1, skipped bad rows 1" in capsys.readouterr().out
    )
    kept = ds.load_sft(path, tok, DataConfig(skip_bad_rows=True, max_len=14, overlong="truncate"))
    assert (
        len(kept) == 2
        and len(kept[1]["input_ids"]) == 14
        and "truncated 1" in capsys.readouterr().out
    )
    with pytest.raises(ds.DataError, match="no usable rows"):
        ds.load_sft(
            _write(tmp_path, [{"input": "a"}], "e.jsonl"), tok, DataConfig(skip_bad_rows=True)
        )


def test_pairs_collate_chosen_then_rejected(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "ab=", "chosen": "ba", "rejected": "aab"}])
    batch = ds.collate_pairs(tok.pad_token_id)(ds.load_pairs(path, tok, DataConfig()))
    assert batch["input_ids"].shape[0] == 2
    assert tok.decode(batch["input_ids"][0], skip_special_tokens=True) == "ab=ba"
    assert tok.decode(batch["input_ids"][1], skip_special_tokens=True) == "ab=aab"


def test_parquet_and_json_array_files(tmp_path, tok):
    import pandas as pd

    rows = [{"input": "ab=", "output": "ba"}, {"input": "abc=", "output": "cba"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    from_parquet = ds.load_sft(str(tmp_path / "d.parquet"), tok, DataConfig())
    from_json = ds.load_sft(str(tmp_path / "d.json"), tok, DataConfig())
    assert from_parquet == from_json == ds.load_sft(_write(tmp_path, rows), tok, DataConfig())
    assert len(ds.load_sft(str(tmp_path / "d.parquet"), tok, DataConfig(), max_samples=1)) == 1


def test_chat_template_wraps_prompt_only(tmp_path, tok):
    import copy

    tok = copy.deepcopy(tok)  # the fixture is shared: keep its own template
    tok.chat_template = (
        "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    path = _write(tmp_path, [{"input": "ab", "output": "ba"}])
    sample = ds.load_sft(path, tok, DataConfig(apply_chat_template=True))[0]
    text = tok.decode(sample["input_ids"], skip_special_tokens=True)
    assert text.endswith("ba") and "ab" in text and "=" in text
    n_prompt = sum(v == -100 for v in sample["labels"])
    assert tok.decode(sample["input_ids"][:n_prompt]).endswith(
        "="
    )  # template (with generation prompt) is masked


# ------------------------------------------------------------ chat rows


def test_two_turn_chat_scores_assistant_content_and_end_of_turn_only(tok):
    from strategy.trainers.data.chat import tokenize_chat

    messages = [{"role": "system", "content": "="}, {"role": "user", "content": "ab="},
                {"role": "assistant", "content": "ba"}, {"role": "user", "content": "cde="},
                {"role": "assistant", "content": "edc"}]
    ids, labels = tokenize_chat(tok, messages, "row")
    tokens = tok.convert_ids_to_tokens(ids)
    assert "".join(tokens) == "<system>=<user>ab=<assistant>ba<eos><user>cde=<assistant>edc<eos>"
    scored = [t if label != -100 else "_" for t, label in zip(tokens, labels)]
    # written out by hand: the two answers and the <eos> that closes each, nothing else
    want = ["_"] * 7 + ["b", "a", "<eos>"] + ["_"] * 6 + ["e", "d", "c", "<eos>"]
    assert scored == want
    assert all(label in (-100, token) for token, label in zip(ids, labels))


def test_chat_rows_load_pack_and_truncate(tmp_path, tok):
    chat = {"messages": [{"role": "user", "content": "abc="},
                         {"role": "assistant", "content": "cba"}]}
    path = _write(tmp_path, [chat, {"input": "ab=", "output": "ba"}, chat])
    rows = ds.load_sft(path, tok, DataConfig(max_len=16))
    assert len(rows) == 3 and rows[0]["labels"].count(-100) == 6  # <user>abc=<assistant>
    from strategy.trainers.data.packing import pack

    packed = pack(rows, max_len=16)
    assert sum(len(p["input_ids"]) for p in packed) == sum(len(r["input_ids"]) for r in rows)
    cut = ds.load_sft(path, tok, DataConfig(max_len=7, overlong="truncate"))
    assert [len(r["input_ids"]) for r in cut] == [7, 6, 7]  # the chat keeps 1 answer token
    with pytest.raises(ds.DataError, match="row 0: .* over max_len=4"):
        ds.load_sft(path, tok, DataConfig(max_len=4, overlong="error"))


BAD_CHATS = [
    ([{"role": "robot", "content": "x"}], "row 0: unknown role 'robot'"),
    ([{"role": "user", "content": "ab="}], "row 0: no assistant turn"),
    ([{"role": "user"}, {"role": "assistant", "content": "a"}], "row 0: a user turn has no text"),
    ([], "row 0: messages must be a non-empty list"),
]


@pytest.mark.parametrize("messages,message", BAD_CHATS)
def test_bad_chat_rows_name_file_and_row(tmp_path, tok, messages, message):
    path = _write(tmp_path, [{"messages": messages}])
    with pytest.raises(ds.DataError, match=message) as err:
        ds.load_sft(path, tok, DataConfig())
    assert path in str(err.value) and "\n" not in str(err.value)


def test_chat_needs_a_template(tmp_path, tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}]}])
    with pytest.raises(ds.DataError, match="row 0: the tokenizer has no chat_template"):
        ds.load_sft(path, plain, DataConfig())


def test_step_time_counts_the_time_a_step_takes_to_produce():
    """A rollout (or loading a batch) is part of its step: the meter times a step from when the
    loop asks for it (``timed``), not from the start of the update. Sleeping gives a lower bound
    that holds on any machine."""
    import time

    from strategy.trainers.loop.throughput import StepMeter

    class OneRank:  # only the reductions the report makes, over a single rank
        world_size = data_parallel_size = 1

        def all_reduce(self, value, op="mean"):
            return value

    meter = StepMeter(torch.nn.Linear(2, 2), OneRank())

    def rollouts():
        for _ in range(2):
            time.sleep(0.2)
            yield {}

    for _ in meter.timed(rollouts()):
        meter.start()  # what train_step does first
        meter.finish({})
    assert meter.report()["step_time"] >= 0.2
