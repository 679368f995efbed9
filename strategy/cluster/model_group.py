"""Frozen models in Ray groups of their own, as OpenRLHF places them: the reference
(``--ref_num_nodes``/``--ref_num_gpus_per_node`` without ``--colocate_actor_ref``) and the reward
model (``--reward_num_nodes``/``--reward_num_gpus_per_node`` without
``--colocate_critic_reward``). Each rank is a Ray actor running our ``DeepSpeedStrategy`` with the
model as an eval engine on a device of its own, the group's rendezvous its own; actor rank ``i``
asks rank ``i mod size`` (the reference: each micro-batch's log-probs; the reward model: each
completion's score).

Each rank takes one call at a time and is asked as often as every other (the group's size divides
the actor group's), so the ranks' ZeRO-3 gathers pair up as a launcher's ranks' would.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from strategy.dist import free_port


class RayRank:
    """What the driver asks of each rank it places: where it runs, and (of a group's first
    rank) the group's rendezvous."""

    def where(self) -> dict:
        import ray  # the optional extra: a Ray job only

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "devices": [str(d) for d in context.get_accelerator_ids().get("GPU", [])],
                "pid": os.getpid()}

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's, for the group's store)."""
        import ray  # the optional extra: a Ray job only

        return ray.util.get_node_ip_address(), free_port()


class FrozenRank(RayRank):
    """One rank of a reference or reward group, in a Ray actor (made remote by the driver)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.temperature = 1.0

    def start(self, kind: str, command: str, argv: list[str], env: dict[str, str],
              cwd: str) -> None:
        """The strategy (this group's ranks only) and the frozen model, loaded as the actor
        group's ranks would load it, from the job's settings checked as they check them."""
        from strategy.checkpoint import CheckpointConfig  # heavy: a Ray job's start only
        from strategy.cluster.settings import configs  # as above
        from strategy.config import StrategyConfig  # as above
        from strategy.deepspeed_strategy import DeepSpeedStrategy  # as above
        from strategy.optim import OptimConfig  # as above
        from strategy.trainers.algorithms.preference import reference_model  # as above
        from strategy.trainers.algorithms.rewards import model_reward  # as above
        from strategy.trainers.config import (  # as above
            DataConfig,
            LoraConfig,
            ModelConfig,
            TrainConfig,
        )
        from strategy.trainers.run import Run, load_tokenizer  # as above

        if os.path.isdir(cwd):  # the driver's folder, where this node sees it (relative paths)
            os.chdir(cwd)
        by_type = configs(command, argv)
        os.environ.update(env)
        strategy = DeepSpeedStrategy(by_type[StrategyConfig], by_type[OptimConfig],
                                     by_type[CheckpointConfig])
        strategy.setup_distributed()
        run = Run(strategy, model_cfg=by_type[ModelConfig], train=by_type[TrainConfig],
                  data=by_type[DataConfig], lora=by_type[LoraConfig], configs=by_type)
        run.tokenizer = load_tokenizer(run.model_cfg)
        trainer = next(c for c in by_type.values() if hasattr(c, "kl_coef"))
        if kind == "ref":
            self.model = strategy.prepare(reference_model(run, None))
            self.temperature = trainer.temperature
        else:
            self.model = model_reward(run, trainer)

    def logps(self, batch: dict) -> torch.Tensor:
        """The reference's log-probs of ``batch``'s targets (a trainer's micro-batch)."""
        from strategy.trainers.losses.lm import token_logps  # as ``start``

        device = torch.device(self.model.device)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.no_grad():
            return token_logps(self.model, moved, self.temperature)[0].cpu()

    def scores(self, prompts: list[str], completions: list[str],
               ended: list[bool] | None) -> list[float]:
        """The reward model's score of each prompt + completion (``ModelReward``)."""
        return self.model(prompts, completions, [], ended)
