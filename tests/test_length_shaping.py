"""Length shaping of on-policy rewards (DAPO's overlong punishment, ProRL's stop-properly
penalty) against OpenRLHF's ``length_penalty.py`` on the same rollouts, and by hand."""

from __future__ import annotations

import pytest
import torch

from strategy.errors import ConfigError
from strategy.trainers.config import GRPOConfig
from strategy.trainers.losses import length_shaped_rewards
from tests.support import peer_rl

MAX_NEW = 16
LENGTHS = torch.tensor([1, 11, 12, 13, 15, 16, 16, 4])  # 16 and no end token: truncated
TRUNCATED = torch.tensor([False, False, False, False, False, True, True, False])
REWARDS = torch.tensor([1.0, 0.5, -0.25, 1.0, 0.0, 1.0, -1.0, 0.75])


@pytest.mark.parametrize("buffer,factor,coef", [
    (4, 1.0, None), (4.0, 0.5, None), (None, 1.0, 0.3), (None, 1.0, -0.5), (6, 2.0, 0.0),
    (4, 1.0, -0.5), (16, 1.0, 1.0)])
def test_length_penalties_equal_openrlhf(buffer, factor, coef):
    ours, hits = length_shaped_rewards(REWARDS, LENGTHS, TRUNCATED, MAX_NEW, buffer, factor, coef)
    theirs, counts = peer_rl.apply_length_penalties(REWARDS, LENGTHS, TRUNCATED, MAX_NEW, buffer,
                                                    factor, coef)
    torch.testing.assert_close(ours, theirs)
    if buffer is not None:
        assert hits["overlong_penalized"] == (counts[0], len(REWARDS))
    if coef is not None:
        assert hits["truncated_penalized"] == (counts[1], len(REWARDS))


def test_length_penalties_by_hand():
    """Buffer 4 of 16: up to 12 tokens nothing, then -1/4 per token, -1 at 16 and no lower."""
    out, hits = length_shaped_rewards(torch.zeros(8), LENGTHS, TRUNCATED, MAX_NEW, 4)
    assert out.tolist() == [0.0, 0.0, 0.0, -0.25, -0.75, -1.0, -1.0, 0.0]
    assert hits == {"overlong_penalized": (4.0, 8)}
    out, _ = length_shaped_rewards(REWARDS, LENGTHS, TRUNCATED, MAX_NEW,
                                   stop_properly_penalty_coef=-0.5)
    assert out.tolist() == [1.0, 0.5, -0.25, 1.0, 0.0, -0.5, -0.5, 0.75]
    same, hits = length_shaped_rewards(REWARDS, LENGTHS, TRUNCATED, MAX_NEW)
    assert torch.equal(same, REWARDS) and hits == {}


def test_length_shaping_settings():
    base = {"reward_fn": "m:f", "max_new_tokens": 16}
    for change, message in [
            ({"overlong_buffer_len": 17}, "overlong_buffer_len=17 is invalid: use 1 to "
             "max_new_tokens=16"),
            ({"overlong_buffer_len": 0}, "overlong_buffer_len=0 is invalid"),
            ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor=-1.0 is invalid"),
            ({"stop_properly_penalty_coef": 1.5}, "stop_properly_penalty_coef=1.5 is invalid")]:
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(**base, **change)
    GRPOConfig(**base, overlong_buffer_len=16, stop_properly_penalty_coef=-0.5)
