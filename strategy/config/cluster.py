"""``ClusterConfig``: where an online-RL job's groups run on Ray (OpenRLHF's placement flags:
``--actor.num_nodes`` is ``--actor_num_nodes`` here). Read by the driver alone; the ranks it
starts parse and ignore it."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.fields import check_positive, doc
from strategy.errors import fail

RAY_TRAINERS = ("grpo", "ppo")
DEVICE_RESOURCES = ("GPU", "CPU")


@dataclass(frozen=True)
class ClusterConfig:
    """A Ray job's placement. Validated on construction."""

    ray: bool = doc(
        "run on Ray (python -m strategy.cli.train_ppo_ray sets it): this process drives, the "
        "actor group's ranks and the vLLM engines are Ray actors placed by the flags below, on "
        "any node of the cluster (pip install '.[ray]')", False, trainers=RAY_TRAINERS)
    ray_address: str | None = doc(
        "the Ray cluster to join (default: RAY_ADDRESS, else a Ray started here for this job "
        "and ended with it)", None, trainers=RAY_TRAINERS)
    ray_device: str = doc(
        "the Ray resource one bundle (one rank's device) asks for: GPU (on a cluster without "
        "GPUs, logical ones its nodes declare: ray start --num-gpus N) or CPU", "GPU",
        trainers=RAY_TRAINERS)
    ray_timeout: float = doc(
        "Ray: seconds the placement and each actor's start may take before the job stops "
        "with one line", 300.0, trainers=RAY_TRAINERS)
    actor_num_nodes: int = doc("Ray: nodes of the actor (policy) group", 1,
                               trainers=RAY_TRAINERS)
    actor_num_gpus_per_node: int = doc(
        "Ray: ranks (devices) of the actor group per node; its world size is nodes x this", 1,
        trainers=RAY_TRAINERS)
    ref_num_nodes: int | None = doc(
        "Ray: the reference model's nodes; it runs inside the actor group's ranks here, so "
        "only the actor's placement (or none) is taken", None, trainers=RAY_TRAINERS)
    ref_num_gpus_per_node: int | None = doc(
        "Ray: the reference model's devices per node (as ref_num_nodes)", None,
        trainers=RAY_TRAINERS)
    critic_num_nodes: int | None = doc(
        "Ray: the critic's nodes (PPO); it runs inside the actor group's ranks here (as "
        "ref_num_nodes)", None, trainers=RAY_TRAINERS)
    critic_num_gpus_per_node: int | None = doc(
        "Ray: the critic's devices per node (as critic_num_nodes)", None, trainers=RAY_TRAINERS)
    reward_num_nodes: int | None = doc(
        "Ray: the reward model's nodes; it runs inside the actor group's ranks here (as "
        "ref_num_nodes)", None, trainers=RAY_TRAINERS)
    reward_num_gpus_per_node: int | None = doc(
        "Ray: the reward model's devices per node (as reward_num_nodes)", None,
        trainers=RAY_TRAINERS)
    colocate_all: bool = doc(
        "Ray: the vLLM engines share the actor group's devices (a fractional share each), "
        "one engine of one device per rank's bundle", False, trainers=RAY_TRAINERS)
    colocate_actor_ref: bool = doc(
        "Ray: reference and actor share devices (always so here: the reference runs in the "
        "actor's ranks)", False, trainers=RAY_TRAINERS)
    colocate_critic_reward: bool = doc(
        "Ray: critic and reward model share devices (always so here: both run in the actor's "
        "ranks)", False, trainers=RAY_TRAINERS)

    def __post_init__(self) -> None:
        check_positive(self, "actor_num_nodes", "actor_num_gpus_per_node")
        if self.ray_device not in DEVICE_RESOURCES:
            fail("ray_device", self.ray_device, f"use one of {', '.join(DEVICE_RESOURCES)}")
        if self.ray_timeout <= 0:
            fail("ray_timeout", self.ray_timeout, "use a positive number of seconds, e.g. 300")
        actor = (self.actor_num_nodes, self.actor_num_gpus_per_node)
        for group in ("ref", "critic", "reward"):
            asked = (getattr(self, f"{group}_num_nodes"),
                     getattr(self, f"{group}_num_gpus_per_node"))
            for name, value, same in zip(("num_nodes", "num_gpus_per_node"), asked, actor):
                if value is not None and value != same:
                    fail(f"{group}_{name}", value,
                         f"the {group} model runs inside the actor group's ranks here (a group "
                         f"of its own is not supported yet): give the actor's {same} or drop it")

    @property
    def world_size(self) -> int:
        """The actor group's ranks."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node
