"""On-policy advantages, returns, KL estimators and the clipped policy loss: by hand, and against
OpenRLHF's code (``tests/support/peer_rl.py``) on the same inputs."""

from __future__ import annotations

import pytest
import torch

from strategy.trainers.losses import (
    discounted_returns,
    gae,
    grpo_token_losses,
    kl_estimate,
    outcome_advantages,
    outcome_token_rewards,
    token_moments,
    whiten,
)
from tests.support import peer_rl

# two groups of 4: one with spread, one of equal rewards (zero variance)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
LENGTHS = torch.tensor([3.0, 1.0, 4.0, 2.0, 5.0, 2.0, 1.0, 3.0])


@pytest.mark.parametrize("estimator,first_group", [
    ("dr_grpo", [0.5, -0.5, 0.0, 0.0]),
    ("reinforce_baseline", [0.5, -0.5, 0.0, 0.0]),  # before whitening
    ("rloo", [1 - 1.0 / 3, -2.0 / 3, 0.0, 0.0]),  # less the mean of the other three
    ("reinforce", [1.0, 0.0, 0.5, 0.5]),
])
def test_outcome_estimators_by_hand(estimator, first_group):
    got = outcome_advantages(REWARDS, 4, estimator)
    torch.testing.assert_close(got[:4], torch.tensor(first_group))
    want_rest = [2.0] * 4 if estimator == "reinforce" else [0.0] * 4  # zero variance: no push
    assert got[4:].tolist() == want_rest


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "reinforce",
                                       "reinforce_baseline"])
def test_outcome_estimators_equal_openrlhf(estimator):
    torch.manual_seed(0)
    rewards = torch.randn(24)
    ours = outcome_advantages(rewards, 6, estimator, eps=1e-9)  # OpenRLHF's group std eps
    torch.testing.assert_close(ours, peer_rl.shaped_rewards(rewards, 6, estimator))


def test_whitening_is_token_weighted_like_openrlhf_and_the_same_at_any_split():
    torch.manual_seed(1)
    adv = outcome_advantages(REWARDS + torch.rand(8), 4, "reinforce_baseline")
    whole = whiten(adv, token_moments(adv, LENGTHS))
    width = int(LENGTHS.max())
    masks = [(torch.arange(width) < n).float()[None] for n in LENGTHS.tolist()]
    per_token = [a * m for a, m in zip(adv, masks)]  # outcome advantage on each completion token
    theirs = peer_rl.whiten(per_token, masks)
    torch.testing.assert_close(whole, torch.stack([t[0, 0] for t in theirs]))
    shards = [token_moments(adv[i::3], LENGTHS[i::3]) for i in range(3)]  # 3 "ranks", uneven
    summed = {k: sum(s[k] for s in shards) for k in shards[0]}
    torch.testing.assert_close(whiten(adv, summed), whole)
    n = LENGTHS.sum()
    mean = (whole * LENGTHS).sum() / n
    assert abs(mean) < 1e-6 and abs((whole.pow(2) * LENGTHS).sum() / n - 1) < 1e-5


def test_gae_and_returns_by_hand_and_against_openrlhf():
    gamma, lambd = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0], [0.5, -1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.2, 9.0], [0.1, 0.3, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # padding masked out
    adv, ret = gae(rewards, values, mask, gamma, lambd)
    d2 = 1.0 - 0.2  # delta_2 = r2 + gamma * 0 (masked) - V2
    d1 = 0.0 + gamma * 0.2 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.5
    a2, a1 = d2, d1 + gamma * lambd * d2
    a0 = d0 + gamma * lambd * a1
    torch.testing.assert_close(adv[0, :3], torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(ret[0, :3], torch.tensor([a0 + 0.5, a1 + 0.4, a2 + 0.2]))
    theirs = peer_rl.get_advantages_and_returns(values, rewards, mask, gamma, lambd)
    torch.testing.assert_close(adv, theirs[0])
    torch.testing.assert_close(ret, theirs[1])


def test_discounted_returns_by_hand_and_against_openrlhf():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    got = discounted_returns(rewards, mask, 0.5)
    assert got[0].tolist() == [0.25, 0.5, 1.0, 0.0] and got[1].tolist() == [2.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(got, peer_rl.get_cumulative_returns(rewards, mask, 0.5))
    # OpenRLHF's token rewards (outcome on the last action token, -kl_coef x KL on each) give the
    # REINFORCE++ return; with no KL and gamma 1 it is the outcome reward on every token
    token_rewards = peer_rl.compute_reward(torch.tensor([3.0, -1.0]), 0.0, torch.zeros(2, 4),
                                           mask)
    flat = discounted_returns(token_rewards, mask, 1.0)
    assert flat[0, :3].tolist() == [3.0] * 3 and flat[1].tolist() == [-1.0] * 4


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_equal_openrlhf(kind):
    torch.manual_seed(2)
    logp, ref = -torch.rand(5, 7) * 3, -torch.rand(5, 7) * 3  # gaps within OpenRLHF's clamp
    torch.testing.assert_close(kl_estimate(logp, ref, kind),
                               peer_rl.compute_approx_kl(logp, ref, kind))


def test_asymmetric_and_dual_clip_by_hand_and_against_openrlhf():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.3], [0.9, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.6, 0.3], [0.1, 0.3, 0.3]]))
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, -2.0])
    losses, metrics = grpo_token_losses(logp, old, logp, adv, mask, clip_eps=0.2, beta=0.0,
                                        clip_eps_high=0.28, dual_clip=3.0)
    # row 0 (advantage 1): ratios 2, 1.5, 1 -> clipped high at 1.28, 1.28, 1 (DAPO clip-higher)
    # row 1 (advantage -2): ratio 9 -> -2 x 9 = -18, bounded by dual clip at -2 x 3 = -6
    torch.testing.assert_close(losses, torch.tensor([[-1.28, -1.28, -1.0], [6.0, 2.0, 2.0]]))
    assert metrics["clip_fraction"] == (2.0, 6)
    theirs = peer_rl.policy_token_loss(logp, old, adv[:, None], 0.2, 0.28, dual_clip=3.0)
    torch.testing.assert_close(losses, theirs)
    symmetric, _ = grpo_token_losses(logp, old, logp, adv, mask, clip_eps=0.2, beta=0.0)
    assert symmetric[0, 0].item() == pytest.approx(-1.2) and symmetric[1, 0].item() == 18.0


def test_grpo_aggregations_by_hand():
    """``policy_loss_agg``: the step's loss from token losses, through the trainer's own
    ``aggregate`` with the loop's normalisation over the step's items."""
    from types import SimpleNamespace

    from strategy.trainers import GRPOTrainer

    losses = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    counts = {"tokens": 4, "completions": 2}
    want = {"token_mean": 10 / 4, "seq_mean_token_mean": (6 / 3 + 4 / 1) / 2,
            "seq_mean_token_sum_norm": (6 / 8 + 4 / 8) / 2}
    for agg, value in want.items():
        fake = SimpleNamespace(grpo=SimpleNamespace(policy_loss_agg=agg, max_new_tokens=8),
                               normalize=lambda total, key: total / counts[key])
        assert GRPOTrainer.aggregate(fake, losses, mask).item() == pytest.approx(value), agg


def test_kl_in_the_reward_gives_openrlhfs_per_token_returns():
    """``--kl_in_reward``: the outcome on the last completion token, -kl_coef x KL on each,
    returns with gamma 1 (OpenRLHF's compute_reward then get_cumulative_returns)."""
    torch.manual_seed(3)
    outcome = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    kl = torch.rand(3, 4) * mask
    ours = discounted_returns(outcome_token_rewards(outcome, mask) - 0.1 * kl, mask, 1.0)
    theirs = peer_rl.get_cumulative_returns(peer_rl.compute_reward(outcome, 0.1, kl, mask), mask,
                                            1.0)
    torch.testing.assert_close(ours, theirs)
    assert outcome_token_rewards(outcome, mask)[1].tolist() == [0.0, -0.5, 0.0, 0.0]
    first = outcome[0] - 0.1 * kl[0, :3].sum()  # the return from the first token: all of it
    assert ours[0, 0].item() == pytest.approx(first.item())
