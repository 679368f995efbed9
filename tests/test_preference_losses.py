"""The preference losses on hand-built log-probs: each equals its paper's formula (written out
with ``math``, one pair at a time) and its peer's implementation (``tests/support/peer_losses``,
transcribed from TRL and OpenRLHF) to 1e-6; KTO's unpaired data and mismatched KL pairs; the
settings' one-line refusals."""

from __future__ import annotations

import math

import pytest
import torch

from strategy.errors import ConfigError
from strategy.trainers.config import DPOConfig, KTOConfig, SimPOConfig
from strategy.trainers.losses import dpo_losses, kto_losses, orpo_losses, simpo_losses
from tests.support import peer_losses as peer

# summed response log-probs of 6 pairs (policy, reference): margins of both signs, a tie
PC = torch.tensor([-12.0, -30.5, -4.25, -9.0, -55.0, -7.5])
PR = torch.tensor([-14.0, -28.0, -4.25, -20.0, -50.5, -7.0])
RC = torch.tensor([-13.0, -30.0, -5.0, -10.0, -52.0, -7.5])
RR = torch.tensor([-13.5, -29.0, -4.0, -18.0, -51.0, -8.0])
# mean per-token log-probs (reference-free methods)
MC = torch.tensor([-0.8, -2.1, -0.05, -1.3, -3.0, -0.6])
MR = torch.tensor([-1.1, -1.9, -0.07, -2.6, -2.4, -0.6])


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _paper_dpo(h: float, beta: float, ls: float, kind: str) -> float:
    if kind == "sigmoid":  # Rafailov et al. eq. 7; cDPO (Mitchell 2023) with ls
        return -(1 - ls) * math.log(_sig(beta * h)) - ls * math.log(_sig(-beta * h))
    if kind == "robust":  # Chowdhury et al. 2024 eq. 6
        return ((1 - ls) * -math.log(_sig(beta * h)) - ls * -math.log(_sig(-beta * h))) / (
            1 - 2 * ls)
    if kind == "hinge":  # SLiC (Zhao et al. 2023)
        return max(0.0, 1 - beta * h)
    return (h - 1 / (2 * beta)) ** 2  # IPO (Azar et al. 2023) eq. 17


@pytest.mark.parametrize("kind", ["sigmoid", "robust", "hinge", "ipo"])
def test_dpo_loss_types_equal_their_papers_and_peers(kind):
    beta, ls = 0.3, (0.2 if kind in ("sigmoid", "robust") else 0.0)
    losses, metrics = dpo_losses(PC, PR, RC, RR, beta, ls, kind)
    for i in range(len(PC)):
        h = float((PC[i] - RC[i]) - (PR[i] - RR[i]))
        assert losses[i].item() == pytest.approx(_paper_dpo(h, beta, ls, kind), rel=1e-6,
                                                 abs=1e-7)
    if kind in ("sigmoid", "ipo"):  # OpenRLHF: summed log-probs for both
        theirs = peer.openrlhf_dpo_losses(PC, PR, RC, RR, beta, ls, ipo=kind == "ipo")[0]
    else:  # TRL's robust and hinge (summed log-probs)
        theirs = peer.trl_dpo_losses(PC, PR, RC, RR, beta, ls, kind)[0]
    torch.testing.assert_close(losses, theirs, rtol=1e-6, atol=1e-6)
    chosen, rejected = beta * (PC - RC), beta * (PR - RR)
    assert metrics["reward_accuracy"] == (float((chosen > rejected).sum()), 6)
    assert metrics["chosen_reward"][0] == pytest.approx(float(chosen.sum()), rel=1e-6)


def test_trl_length_normalises_ipo_and_we_follow_openrlhf():
    """TRL's IPO divides each side's log-ratio by its token count; OpenRLHF's (and ours) does
    not: the two differ unless every response has one token."""
    ours = dpo_losses(PC, PR, RC, RR, 0.3, 0.0, "ipo")[0]
    lengths = torch.tensor([4.0, 9, 2, 5, 11, 3])
    trl = peer.trl_dpo_losses(PC, PR, RC, RR, 0.3, 0.0, "ipo", chosen_lengths=lengths,
                              rejected_lengths=lengths)[0]
    assert not torch.allclose(ours, trl, rtol=1e-3)
    ones = torch.ones(6)
    torch.testing.assert_close(ours, peer.trl_dpo_losses(
        PC, PR, RC, RR, 0.3, 0.0, "ipo", chosen_lengths=ones, rejected_lengths=ones)[0])


def test_simpo_equals_its_paper_and_trl():
    beta, gamma, ls = 2.5, 1.4, 0.1
    losses, metrics = simpo_losses(MC, MR, beta, gamma, ls)
    for i in range(len(MC)):  # Meng et al. 2024 eq. 6 (with cDPO smoothing)
        z = beta * float(MC[i] - MR[i]) - gamma
        expected = -(1 - ls) * math.log(_sig(z)) - ls * math.log(_sig(-z))
        assert losses[i].item() == pytest.approx(expected, rel=1e-6)
    theirs, chosen, rejected = peer.trl_simpo_losses(MC, MR, beta, gamma, ls)
    torch.testing.assert_close(losses, theirs, rtol=1e-6, atol=1e-6)
    assert metrics["chosen_reward"][0] == pytest.approx(float(chosen.sum()), rel=1e-6)
    assert metrics["reward_accuracy"] == (float((chosen > rejected).sum()), 6)


def test_orpo_equals_its_paper_and_trl():
    lam = 0.25
    losses, metrics = orpo_losses(MC, MR, lam)
    for i in range(len(MC)):  # Hong et al. 2024 eqs. 4-7: odds(y) = p / (1 - p)
        pc, pr = math.exp(MC[i]), math.exp(MR[i])
        log_or = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        assert losses[i].item() == pytest.approx(-lam * math.log(_sig(log_or)), rel=1e-6)
    theirs, chosen, _, _, log_odds_mean = peer.trl_orpo_losses(MC, MR, lam)
    torch.testing.assert_close(losses, -theirs, rtol=1e-6, atol=1e-7)  # TRL subtracts its own
    nll = torch.tensor(1.7)  # TRL's total: nll - mean(its losses) = nll + mean(ours)
    torch.testing.assert_close(nll + losses.mean(), peer.trl_orpo_total_loss(nll, theirs))
    total, count = metrics["log_odds_ratio"]
    assert total / count == pytest.approx(float(log_odds_mean), rel=1e-6)


def test_kto_equals_its_paper_and_both_peers():
    beta, wd, wu = 0.2, 1.0, 1.7
    policy, ref = PC, RC
    desirable = torch.tensor([True, False, True, True, False, False])
    kl_policy, kl_ref = PR, RR  # log-probs of mismatched sequences
    z0 = max(float((kl_policy - kl_ref).mean()), 0.0)
    losses, metrics = kto_losses(policy, ref, desirable, z0, beta, wd, wu)
    for i in range(6):  # Ethayarajh et al. 2024 eq. 8 (1 - value, weighted)
        r = float(policy[i] - ref[i])
        expected = wd * (1 - _sig(beta * (r - z0))) if desirable[i] else \
            wu * (1 - _sig(beta * (z0 - r)))
        assert losses[i].item() == pytest.approx(expected, rel=1e-6)
    good = desirable
    args = (policy[good], policy[~good], kl_policy, ref[good], ref[~good], kl_ref, beta, wd, wu)
    trl, trl_chosen, _, trl_kl = peer.trl_kto_losses(*args)
    orl = peer.openrlhf_kto_losses(*args)[0]
    ours = torch.cat([losses[good], losses[~good]])  # the peers put desirable ones first
    assert float(trl_kl) == pytest.approx(z0, rel=1e-6)
    torch.testing.assert_close(ours, trl, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours, orl, rtol=1e-6, atol=1e-7)
    assert metrics["chosen_reward"] == (pytest.approx(float(trl_chosen.sum()), rel=1e-6), 3)


def test_kto_reference_point_is_clamped_at_zero_by_the_trainer_not_the_formula():
    r = torch.tensor([0.5, -0.5])
    flags = torch.tensor([True, False])
    at_zero = kto_losses(r, torch.zeros(2), flags, 0.0, 1.0)[0]
    shifted = kto_losses(r, torch.zeros(2), flags, 0.4, 1.0)[0]
    assert at_zero[0] < shifted[0] and at_zero[1] > shifted[1]  # z0 moves both sides


# ------------------------------------------------------------ KTO data


def _rows():
    return [{"prompt": "ab", "completion": "ba", "label": True},
            {"prompt": "ab", "completion": "cc", "label": False},
            {"prompt": "abc", "completion": "cba", "label": True},
            {"prompt": "ca", "chosen": "ac", "rejected": "aa"}]


def test_kto_rows_and_pairs_load_with_mismatched_sequences(tmp_path, tok):
    import json

    from strategy.trainers.config import DataConfig
    from strategy.trainers.data import unpaired

    path = tmp_path / "kto.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows()))
    samples = unpaired.load_kto(str(path), tok, DataConfig(max_len=32))
    assert [s["desirable"] for s in samples] == [True, False, True, True, False]
    prompts = [tok.decode([t for t, v in zip(s["input_ids"], s["labels"]) if v == -100])
               for s in samples]
    for i, s in enumerate(samples):  # own prompt, another prompt's completion
        start = s["kl_labels"].index(next(v for v in s["kl_labels"] if v != -100))
        assert s["kl_ids"][:start] == s["input_ids"][:start]
        partner = [j for j in range(len(samples)) if prompts[j] != prompts[i]]
        completion = s["kl_ids"][start:]
        assert any(completion == samples[j]["input_ids"][len(samples[j]["input_ids"])
                   - len(completion):] for j in partner), i
    batch = unpaired.collate_kto(tok.pad_token_id)(samples[:3])
    assert batch["desirable"].tolist() == [True, False, True]
    assert unpaired.mismatched(batch)["input_ids"].shape[0] == 3


def test_kto_row_without_a_boolean_label_is_one_line(tmp_path, tok):
    import json

    from strategy.trainers.config import DataConfig
    from strategy.trainers.data import DataError, unpaired

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "completion": "ba", "label": "yes"}))
    with pytest.raises(DataError, match=r"row 0: 'label' is 'yes', not true/false"):
        unpaired.load_kto(str(path), tok, DataConfig(max_len=32))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from strategy.demos.toy_task import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


# ------------------------------------------------------------ settings


@pytest.mark.parametrize("kwargs, message", [
    ({"ipo": True, "loss_type": "hinge"}, "ipo=True is invalid"),
    ({"loss_type": "exo"}, "loss_type='exo' is invalid"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing=0.1 is invalid"),
])
def test_dpo_settings_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DPOConfig(**kwargs)


def test_openrlhf_ipo_flag_is_the_ipo_loss():
    assert DPOConfig(ipo=True).loss_type == "ipo"


@pytest.mark.parametrize("cls, kwargs, field", [
    (SimPOConfig, {"simpo_beta": 0.0}, "simpo_beta"),
    (SimPOConfig, {"simpo_gamma": -1.0}, "simpo_gamma"),
    (KTOConfig, {"undesirable_weight": -1.0}, "undesirable_weight"),
])
def test_method_settings_refused_in_one_line(cls, kwargs, field):
    with pytest.raises(ConfigError, match=f"{field}="):
        cls(**kwargs)
