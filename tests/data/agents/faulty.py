"""Fails as AGENT_FAULT says, on rank 1 only, at turn 1 of its first rollout's episode 2: raise (a
ValueError) or hang (sleeps far past any --agent_timeout)."""

import os
import time

from strategy.agents import AgentInstanceBase

COUNT = {"episodes": 0}


class AgentInstance(AgentInstanceBase):
    def __init__(self):
        self.turn, self.index = 0, COUNT["episodes"]
        COUNT["episodes"] += 1

    async def step(self, states):
        self.turn += 1
        if os.environ.get("RANK") == "1" and self.turn == 2 and self.index == 2:
            if os.environ.get("AGENT_FAULT") == "hang":
                time.sleep(3600)
            raise ValueError("the environment broke")
        return {"rewards": 0.5, "done": self.turn >= 3, "environment_feedback": "<user>a="
                "<assistant>"}
