"""An agent file in the shape of OpenRLHF's examples/python/agent_func.py (an n-step environment:
1 to 3 feedback rounds drawn at random, async methods, tensor rewards, the sampling parameters
handed back, an AgentExecutor), its import line OpenRLHF's own."""

import random
from typing import Any, Dict

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        done = self.step_idx >= self.max_steps
        right = states["action_text"] == states["label"]
        reward = torch.tensor(float(right)) if done else torch.tensor(0.0)
        feedback = "" if done else ("<user>" + ("a" if right else "b") + "=<assistant>")
        self.step_idx += 1
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"rounds": torch.tensor(float(self.max_steps))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
