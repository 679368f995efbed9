"""Three model turns per episode, plain def methods: after each turn the environment says how many
letters of the reversal were right ("<user>" + that many "a"s + "=<assistant>") and rewards the
turn with the share right; the episode's reward is the sum of its turns'."""

from strategy.agents import AgentInstanceBase
from strategy.demos.toy_task import reversal_reward


class AgentInstance(AgentInstanceBase):
    def __init__(self):
        self.turn = 0

    def reset(self, states):
        return {"observation": states["observation"]}

    def step(self, states):
        self.turn += 1
        answer = states["action_text"]
        score = reversal_reward("", answer, {"output": states["label"]})
        right = sum(a == b for a, b in zip(answer, states["label"]))
        done = self.turn >= 3
        return {"rewards": score, "done": done, "extra_logs": {"right": right},
                "environment_feedback": "" if done else "<user>" + "a" * right + "=<assistant>"}
