"""GSPO and CISPO (``--policy_loss_type``) against their formulas and their peers' code on the
same log-probs: OpenRLHF's ``PolicyLoss(policy_loss_type="gspo")`` and TRL 1.16's
``importance_sampling_level="sequence"`` and ``loss_type="cispo"`` (``tests/support/peer_rl.py``):
losses and gradients with respect to the policy's log-probs."""

from __future__ import annotations

import pytest
import torch

from strategy.errors import ConfigError
from strategy.trainers.config import GRPOConfig, PPOConfig
from strategy.trainers.losses import grpo_token_losses
from tests.support import peer_rl

LENGTHS = (1, 7, 3, 12, 5, 9)  # completions of very different lengths, one of a single token


def _batch(seed: int = 0):
    """Log-probs whose ratios reach past both clip bounds, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(rows, width)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    old = -torch.rand(rows, width, generator=g) * 3
    logp = (old + torch.randn(rows, width, generator=g) * 0.4).requires_grad_(True)
    adv = torch.tensor([1.5, -0.7, 0.3, -1.2, 0.9, -0.2])
    return logp, old * mask, adv, mask


def _ours(logp, old, adv, mask, kind, agg, low=0.2, high=0.28, dual=None):
    losses, metrics = grpo_token_losses(logp, old, logp.detach(), adv, mask, low, 0.0,
                                        clip_eps_high=high, dual_clip=dual, policy_loss_type=kind)
    if agg == "token_mean":
        return losses.sum() / mask.sum(), metrics
    return (losses.sum(-1) / mask.sum(-1)).mean(), metrics


def _grad(loss, logp):
    return torch.autograd.grad(loss, logp, retain_graph=True)[0]


@pytest.mark.parametrize("dual", [None, 3.0])
def test_gspo_equals_openrlhf_and_trl_sequence_level(dual):
    logp, old, adv, mask = _batch()
    ours, metrics = _ours(logp, old, adv, mask, "gspo", "seq_mean_token_mean", dual=dual)
    theirs = peer_rl.gspo_policy_loss(logp, old, adv[:, None], mask, 0.2, 0.28, dual)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(_grad(ours, logp), _grad(theirs, logp))
    if dual is None:
        trl = peer_rl.trl_per_token_loss(logp, old, adv[:, None], mask, "grpo", 0.2, 0.28,
                                         importance_sampling_level="sequence")
        torch.testing.assert_close(ours, trl)
        torch.testing.assert_close(_grad(ours, logp), _grad(trl, logp))
    assert 0 < metrics["clip_fraction"][0] < metrics["clip_fraction"][1]  # some clipped


def test_gspo_by_hand():
    """One ratio per completion, exp of its mean log-ratio; its gradient spreads evenly over the
    completion's tokens; equal per-token log-ratios make it PPO's per-token loss."""
    logp, old, adv, mask = _batch(1)
    loss, _ = _ours(logp, old, adv, mask, "gspo", "seq_mean_token_mean", low=10.0, high=10.0)
    seq = ((logp - old) * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(loss, (-(seq.exp() * adv)).mean())  # unclipped: -s_i A_i
    grad = _grad(loss, logp)
    expected = -(seq.exp() * adv)[:, None] / mask.sum(-1, keepdim=True) / len(LENGTHS) * mask
    torch.testing.assert_close(grad, expected.detach())
    shift = torch.full_like(old, 0.1)  # the same log-ratio on every token
    same = (old + shift).requires_grad_(True)
    gspo, _ = _ours(same, old, adv, mask, "gspo", "seq_mean_token_mean")
    ppo, _ = _ours(same, old, adv, mask, "ppo", "seq_mean_token_mean")
    torch.testing.assert_close(gspo, ppo)


def test_cispo_equals_trl_and_keeps_every_tokens_gradient():
    logp, old, adv, mask = _batch(2)
    high = 0.15  # small enough that some ratios pass it
    ours, metrics = _ours(logp, old, adv, mask, "cispo", "token_mean", high=high)
    theirs = peer_rl.trl_per_token_loss(logp, old, adv[:, None], mask, "cispo", None, 1 + high)
    torch.testing.assert_close(ours, theirs)
    grad = _grad(ours, logp)
    torch.testing.assert_close(grad, _grad(theirs, logp))
    ratio = (logp - old).exp().detach()
    weight = ratio.clamp(max=1 + high)  # by hand: -sg(w) A / tokens on every scored token
    torch.testing.assert_close(grad, -(weight * adv[:, None]) * mask / mask.sum())
    assert bool((grad[mask.bool()] != 0).all()), "every token keeps a gradient"
    ppo_grad = _grad(_ours(logp, old, adv, mask, "ppo", "token_mean", high=high)[0], logp)
    assert bool((ppo_grad[mask.bool()] == 0).any()), "PPO's clip zeroes some (the contrast)"
    clipped, scored = metrics["clip_fraction"]
    trl = peer_rl.trl_cispo_clip_ratio(logp.detach(), old, adv[:, None], mask, 1 + high)
    assert clipped / scored == pytest.approx(trl.item())  # TRL's cispo_clip_ratio
    over = int(((ratio > 1 + high) & mask.bool()).sum())  # tokens past the bound, any advantage
    assert 0 < clipped < over, "some clamped tokens have a negative advantage: not counted"


def test_policy_loss_type_settings():
    reward = {"reward_fn": "m:f"}
    assert GRPOConfig(**reward).policy_loss_agg == "token_mean"
    assert GRPOConfig(**reward, policy_loss_type="gspo").policy_loss_agg == "seq_mean_token_mean"
    assert PPOConfig(**reward, policy_loss_type="cispo").policy_loss_agg == "token_mean"
    for change, message in [
            ({"policy_loss_type": "grpo"}, "policy_loss_type='grpo' is invalid: use one of ppo, "
             "gspo, cispo"),
            ({"policy_loss_type": "gspo", "policy_loss_agg": "token_mean"},
             "policy_loss_agg='token_mean' is invalid: GSPO's objective"),
            ({"policy_loss_type": "cispo", "dual_clip": 3.0}, "dual_clip=3.0 is invalid: CISPO"),
            ({"policy_loss_type": "cispo", "clip_eps_low": 0.2},
             "clip_eps_low=0.2 is invalid: CISPO clips the weight above only")]:
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(**reward, **change)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_equals_openrlhfs_of_the_samplers_logits(temperature):
    """``token_logps_entropy``'s entropy at each scored position equals OpenRLHF's
    ``compute_entropy`` of the same logits over the temperature (OpenRLHF takes the raw logits:
    the same at its default temperature 1; here it is the distribution the completions were
    drawn from, as the log-probs are); zero elsewhere; its gradient kept only when trained; the
    log-probs are ``token_logps``'s."""
    from transformers import AutoModelForCausalLM

    from strategy.trainers.losses import IGNORE, token_logps, token_logps_entropy
    from strategy.trainers.run import hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama.json", None,
                                                       vocab_size=37))
    ids = torch.randint(0, 37, (3, 9))
    labels = ids.clone()
    labels[:, :4] = IGNORE  # the prompts
    labels[1, 7:] = IGNORE  # a shorter completion
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    logp, mask, entropy = token_logps_entropy(model, batch, temperature, "trained")
    logits = model(input_ids=ids).logits[:, :-1].float()
    want = peer_rl.compute_entropy(logits / temperature)
    torch.testing.assert_close(entropy[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert (entropy[~mask] == 0).all() and entropy.requires_grad
    plain, plain_mask = token_logps(model, batch, temperature)
    assert torch.equal(plain, logp) and torch.equal(plain_mask, mask)
    _, _, logged = token_logps_entropy(model, batch, temperature, "logged")
    assert not logged.requires_grad and torch.equal(logged, entropy.detach())


def test_sampled_eval_metrics_equal_openrlhfs_pass_at_k():
    """``--eval_n_samples 3``: ``pass3`` and ``pass1`` (as ``(sum, count)`` pairs, every rank's
    summed) equal OpenRLHF's ``compute_eval_metrics`` on the same rewards; exact match alike."""
    from strategy.trainers.algorithms.grpo import eval_figures

    rewards = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.9, 0.4]  # 4 prompts x 3
    hits = [False, True, False, False, False, False, True, True, False, False, False, False]
    got = eval_figures(torch.tensor(rewards), hits, list(range(12)), 3, sampled=True)
    mean = {key: total / count for key, (total, count) in got.items()}
    want = peer_rl.eval_pass_at_k(rewards, 3)
    assert mean["pass3"] == pytest.approx(want["pass3"]) and mean["pass3"] == pytest.approx(
        (1 + 0 + 1 + 0.9) / 4)
    assert mean["pass1"] == pytest.approx(want["pass1"]) == mean["reward"]
    assert mean["exact_match"] == pytest.approx(3 / 12)
    assert mean["exact_match_pass3"] == pytest.approx(2 / 4)
    assert got["pass3"][1] == 4 and got["pass1"][1] == 12  # prompts, samples
    assert "pass1" in eval_figures(torch.tensor(rewards[:3]), None, [1, 2, 3], 1, sampled=True)
    assert "pass1" not in [k for k in eval_figures(torch.ones(2), None, [1, 1], 1, sampled=True)
                           if k.startswith("pass") and k != "pass1"]


@pytest.mark.parametrize("values,message", [
    ({"eval_n_samples": 3}, "eval_n_samples=3 is invalid: greedy completions of one prompt "
                            "are all alike; add --eval_temperature T (OpenRLHF's default 0.6) "
                            "or use 1"),
    ({"eval_temperature": -1.0}, "eval_temperature=-1.0 is invalid: use a temperature > 0, or 0 "
                                 "for greedy"),
    ({"eval_n_samples": 0}, "eval_n_samples=0 is invalid"),
    ({"eval_temperature": 0.6, "reward_fn": None, "agent_func_path": "env.py"},
     "eval_temperature=0.6 is invalid: held-out episodes are played greedily here"),
])
def test_eval_sampling_settings_are_refused_in_one_line(values, message):
    values = {"reward_fn": "m:f", **values}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOConfig(**values)
