"""Padding-free packing: rows told apart by position ids alone; packed forwards equal separate
forwards on the supported families; refused families fail with one line; packed pairs give each
sample's log-probability and reward."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForSequenceClassification

from strategy.errors import ConfigError
from strategy.trainers.algorithms.dpo import sequence_logps
from strategy.trainers.data import packing
from strategy.trainers.losses import sequence_scores
from tests.support.models import FAMILIES

SAMPLES = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
           {"input_ids": [8, 9], "labels": [-100, 9]},
           {"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 12, 13]},
           {"input_ids": [14, 15, 16, 17, 18], "labels": [-100, 15, 16, 17, 18]}]


def test_packed_rows_carry_positions_and_no_mask():
    rows = packing.pack(SAMPLES, max_len=6)
    assert [row["seq_lens"] for row in rows] == [[3, 2], [4], [5]]
    batch = packing.collate_packed(0)(rows)
    assert "attention_mask" not in batch and int(batch["token_count"]) == 14
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1]
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 0]  # padding counts on by itself
    # each sample's first label is never scored (it would follow the previous sample)
    assert batch["labels"][0].tolist() == [-100, 6, 7, -100, 9]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_packed_forward_equals_separate_forwards(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    rows = packing.pack(SAMPLES, max_len=9)
    batch = packing.collate_packed(0)(rows)
    samples = iter(SAMPLES)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        for row_number, row in enumerate(rows):
            start = 0
            for length in row["seq_lens"]:
                ids = torch.tensor([next(samples)["input_ids"]])
                alone = model(input_ids=ids, use_cache=False).logits[0]
                torch.testing.assert_close(packed[row_number, start:start + length], alone,
                                           rtol=1e-5, atol=1e-5)
                start += length


@pytest.mark.parametrize("kind", ["opt", "bloom", "mpt"])
def test_families_that_ignore_positions_are_refused(kind):
    with pytest.raises(ConfigError, match=f"packing_samples=True is invalid: model_type '{kind}'"):
        packing.check_packing_family(CONFIG_MAPPING[kind]().model_type)


def _pairs() -> list[dict]:
    pairs = []
    for index, (chosen, rejected) in enumerate([([5, 6], [7]), ([8, 9, 10], [11, 12]),
                                                ([13], [14, 15, 16])]):
        prompt = [3, 4 + index]
        pairs.append({"chosen_ids": prompt + chosen, "chosen_labels": [-100, -100] + chosen,
                      "rejected_ids": prompt + rejected,
                      "rejected_labels": [-100, -100] + rejected})
    return pairs


def test_packed_pairs_give_each_samples_logp_and_reward():
    from strategy.trainers.data import collate_pairs

    pairs = _pairs()
    packed = packing.collate_packed_pairs(0)(packing.pack_pairs(pairs, max_len=6))
    plain = collate_pairs(0)(pairs)
    assert packing.pair_count(packed) == packing.pair_count(plain) == 3
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(FAMILIES["llama"]()).eval()
    with torch.no_grad():
        torch.testing.assert_close(sequence_logps(lm, packed), sequence_logps(lm, plain),
                                   rtol=1e-5, atol=1e-5)
    scorer = AutoModelForSequenceClassification.from_config(
        FAMILIES["llama"](num_labels=1, pad_token_id=0)).eval()
    with torch.no_grad():
        alone = torch.cat([scorer(input_ids=torch.tensor([ids])).logits[:, 0]
                           for ids in [p["chosen_ids"] for p in pairs]
                           + [p["rejected_ids"] for p in pairs]])
        torch.testing.assert_close(sequence_scores(scorer, packed), alone, rtol=1e-5, atol=1e-5)
