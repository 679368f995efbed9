"""Several rewards, weighted; batched reward functions; a reward function that fails or hangs
stops with one line naming it and the sample (unit level; at 2 ranks in tests/test_grpo.py). The
functions live in tests/support/rewards.py."""

from __future__ import annotations

import pytest

from strategy.errors import DataError
from strategy.trainers.algorithms.rewards import CallableReward, Rewards

HERE = "tests.support.rewards"  # stdlib only: a worker imports it in a fraction of a second


PROMPTS, COMPLETIONS = ["p1", "p2", "p3"], ["ab", "x", "abc"]
ROWS = [{"answer": "ab"}, {"answer": "y"}, {"answer": "abc"}]


@pytest.mark.parametrize("timeout", [0.0, 30.0])  # in the rank, and in a worker process
def test_weighted_sum_of_a_per_sample_and_a_batched_reward(timeout):
    parts = [("length_reward", CallableReward(f"{HERE}:length_reward", timeout), 1.0),
             ("match_reward", CallableReward(f"{HERE}:match_reward", timeout), 0.5)]
    rewards = Rewards(parts)
    try:
        total = rewards(PROMPTS, COMPLETIONS, ROWS)
    finally:
        for _, part, _ in parts:
            part.close()
    assert rewards.last == {"length_reward": [2.0, 1.0, 3.0], "match_reward": [1.0, 0.0, 1.0]}
    assert total == [2.5, 1.0, 3.5]
    assert parts[1][1].batched and not parts[0][1].batched


@pytest.mark.parametrize("timeout", [0.0, 30.0])
def test_a_raising_reward_is_one_line_naming_it_and_the_sample(timeout):
    reward = CallableReward(f"{HERE}:raising_reward", timeout)
    with pytest.raises(DataError) as info:
        reward(PROMPTS, COMPLETIONS, ROWS)
    reward.close()
    assert str(info.value) == (f"reward_fn='{HERE}:raising_reward' raised KeyError: 'answer' for "
                               "prompt 'p2'")


def test_a_hanging_reward_is_killed_at_the_timeout_naming_the_sample():
    reward = CallableReward(f"{HERE}:hanging_reward", 1.0)
    with pytest.raises(DataError) as info:
        reward(PROMPTS, COMPLETIONS, ROWS)
    assert str(info.value) == (f"reward_fn='{HERE}:hanging_reward' did not return within "
                               "--reward_timeout=1 s for prompt 'p2'; fix the function or raise "
                               "the limit")
    assert reward._worker is None  # killed, not left sleeping
    assert reward(["p1"], ["a"], [{}]) == [1.0]  # a fresh worker serves the next rollout
    reward.close()


def test_a_batched_reward_must_score_every_completion():
    with pytest.raises(DataError, match="returned 1 scores for 3 completions; return one per"):
        CallableReward(f"{HERE}:short_batch")(PROMPTS, COMPLETIONS, ROWS)
