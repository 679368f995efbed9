"""Padding-free packing: rows told apart by position ids alone; packed forwards and backwards equal
separate forwards on the supported families, with sdpa and with sdpa per sample (``sdpa_varlen``);
refused families fail with one line; packed pairs give each sample's log-probability and reward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForSequenceClassification

from strategy.attention import VARLEN
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


def _separate(model, rows: list[dict], samples: list[dict], width: int) -> list[torch.Tensor]:
    """Each packed row's logits from separate forwards: one per sample, one for the padding."""
    out, samples = [], iter(samples)
    for row in rows:
        pieces = [model(input_ids=torch.tensor([next(samples)["input_ids"]]),
                        use_cache=False).logits[0] for _ in row["seq_lens"]]
        if sum(row["seq_lens"]) < width:  # padding counts on from 0: a sample of its own
            pad = torch.zeros(1, width - sum(row["seq_lens"]), dtype=torch.long)
            pieces.append(model(input_ids=pad, use_cache=False).logits[0])
        out.append(torch.cat(pieces))
    return out


@pytest.mark.parametrize("attention", ["sdpa", VARLEN])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_packed_forward_and_backward_equal_separate_forwards(family, attention):
    """Logits and every weight's gradient (fp32) of packed rows equal the samples run alone,
    with transformers' sdpa (a block-diagonal mask) and with ``sdpa_varlen`` (sdpa per sample)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](),
                                             attn_implementation=attention).eval()
    samples = SAMPLES + [{"input_ids": [20 + i for i in range(n)], "labels": [-100] * n}
                         for n in (7, 2, 5, 1)]  # equal lengths across rows: batched together
    rows = packing.pack(samples, max_len=9)
    batch = packing.collate_packed(0)(rows)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    weights = torch.randn_like(packed)  # a loss that weighs every position differently
    (packed * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.stack(_separate(model, rows, samples, packed.shape[1]))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    (alone * weights).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, vocab_size=96, n_embd=32, n_layer=2, n_head=4,
             n_inner=64, rotary_dim=4, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, n_positions=64,
             max_position_embeddings=64)
FAMILY_CASES = [(kind, {}) for kind in packing.PACKING_FAMILIES if kind != "gemma2"] + [
    ("mistral", {"sliding_window": 3})]  # a window shorter than the row: the dense mask


@pytest.mark.parametrize("kind,extra", FAMILY_CASES,
                         ids=[k + "".join(f"-{n}{v}" for n, v in e.items())
                              for k, e in FAMILY_CASES])
def test_every_packing_family_runs_packed_rows_on_sdpa_varlen(kind, extra):
    """Every family packing accepts (gemma2 has no sdpa in transformers) hands the position ids to
    its attention: packed rows on ``sdpa_varlen`` equal the samples run alone."""
    config = CONFIG_MAPPING[kind]()
    for name, value in {**SMALL, **extra}.items():
        if hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config),  # from_config sets the
                                             attn_implementation=VARLEN).eval()  # attention on
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()  # it
    plain.load_state_dict(model.state_dict())  # the samples alone on transformers' own sdpa
    rows = packing.pack(SAMPLES, max_len=9)
    batch = packing.collate_packed(0)(rows)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        alone = torch.stack(_separate(plain, rows, SAMPLES, packed.shape[1]))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == VARLEN


def test_sdpa_varlen_attends_per_sample_and_keeps_padded_batches(monkeypatch):
    """Each sdpa call of a packed forward covers samples of one length (all of them at once),
    never the whole row; a padded batch with its attention mask runs transformers' sdpa."""
    import strategy.attention as attention

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES["llama"](), attn_implementation=VARLEN)
    rows = packing.pack(SAMPLES + [{"input_ids": [9] * 5, "labels": [9] * 5}], max_len=9)
    batch = packing.collate_packed(0)(rows)  # rows [3 2 4] [5 +4 padding] [5 +4 padding]
    calls = []
    real = attention.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        calls.append((query.shape[0], query.shape[2]))
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    per_layer = sorted(calls[:len(calls) // 2])
    assert per_layer == [(1, 2), (1, 3), (2, 5), (3, 4)], calls
    assert attention.sample_plan(torch.arange(6).expand(3, 6), 3) is None  # one sample a row

    plain = AutoModelForCausalLM.from_config(FAMILIES["llama"](), attn_implementation="sdpa")
    plain.load_state_dict(model.state_dict())
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # left padding, as generation pads
    calls.clear()
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)
    assert calls and all(rows == 2 and length == 4 for rows, length in calls)


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


def _rollout_batch() -> dict:
    """A GRPO micro-batch: prompts of 1 to 9 tokens, completions of 1 to 20, right-padded."""
    from strategy.trainers.losses import padding_free

    g = torch.Generator().manual_seed(4)
    shapes = [(1, 20), (9, 1), (4, 7), (6, 13), (2, 2)]
    ids = [torch.randint(3, 90, (p + c,), generator=g).tolist() for p, c in shapes]
    labels = [[-100] * p + x[p:] for (p, _), x in zip(shapes, ids)]
    width = max(len(x) for x in ids)
    batch = {"input_ids": torch.tensor([x + [0] * (width - len(x)) for x in ids]),
             "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x))
                                             for x in ids])}
    return batch, padding_free(batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize("attention", ["sdpa", VARLEN])
def test_padding_free_rl_forwards_equal_padded_ones(attention):
    """GRPO/PPO's ``--packing_samples``: a micro-batch forwarded without its padding gives each
    completion token's log-prob (at a sampling temperature), its gradient, and a critic's values,
    laid out as the padded forward's, on sdpa (transformers' block mask) and ``sdpa_varlen``."""
    from transformers import AutoModelForTokenClassification

    from strategy.trainers.losses import token_logps, token_values
    from tests.support.models import tiny_llama

    padded, keys = _rollout_batch()
    assert keys["packed_input_ids"].shape == (1, 21 + 10 + 11 + 19 + 4)
    assert keys["packed_position_ids"][0, :22].tolist() == list(range(21)) + [0]
    packed = {**padded, **keys}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama(initializer_range=0.2),
                                             attn_implementation=attention)
    outs = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        model.zero_grad()
        logp, mask = token_logps(model, batch, temperature=0.7)
        (logp * torch.linspace(0, 1, logp.numel()).reshape(logp.shape)).sum().backward()
        outs[name] = (logp.detach(), mask, [p.grad.clone() for p in model.parameters()])
    assert torch.equal(outs["packed"][1], outs["padded"][1]) and int(outs["padded"][1].sum()) == 43
    torch.testing.assert_close(outs["packed"][0], outs["padded"][0], rtol=1e-5, atol=1e-5)
    assert (outs["packed"][0][~outs["packed"][1]] == 0).all()
    for got, want in zip(outs["packed"][2], outs["padded"][2]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    critic = AutoModelForTokenClassification.from_config(
        tiny_llama(num_labels=1, initializer_range=0.2, classifier_dropout=0.0),
        attn_implementation=attention)  # no dropout: the critic Run.critic builds
    values, mask = token_values(critic, packed)
    want, want_mask = token_values(critic, padded)
    assert torch.equal(mask, want_mask)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)
