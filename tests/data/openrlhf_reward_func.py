# An OpenRLHF reward file, in the form of OpenRLHF 0.11's examples/python/reward_func.py and
# math_reward_func.py (Apache-2.0, https://github.com/OpenRLHF/OpenRLHF): reward_func(queries,
# prompts, labels, **kwargs) -> {"rewards", "scores", "extra_logs"}, tensors. Here it rewards the
# toy task's exact reversal: the response is the query after its prompt, without its end token.
import torch


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if isinstance(prompt, str) and prompt in query else query
        response = response.removesuffix("<eos>")
        rewards.append(1.0 if response == label else 0.0)
    rewards_tensor = torch.tensor(rewards, dtype=torch.float)
    return {"rewards": rewards_tensor, "scores": rewards_tensor,
            "extra_logs": {"exact_accuracy": rewards_tensor.mean()}}
