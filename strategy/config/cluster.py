"""``ClusterConfig``: where an online-RL job's groups run on Ray (OpenRLHF's placement flags:
``--actor.num_nodes`` is ``--actor_num_nodes`` here). Read by the driver alone; the ranks it
starts parse and ignore it."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.fields import check_positive, doc
from strategy.errors import fail

RAY_TRAINERS = ("grpo", "ppo")
COLOCATE = {  # a group's name, colocation flag, and when it runs inside the actor's ranks
    "ref": ("reference", "--colocate_actor_ref", "--colocate_actor_ref or --colocate_all"),
    "critic": ("critic", "--colocate_critic_reward",
               "--colocate_critic_reward or --colocate_all"),
    "reward": ("reward model", "--colocate_critic_reward",
               "--colocate_critic_reward or --colocate_all"),
}
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
        "Ray: the reference model's nodes (1 if only ref_num_gpus_per_node is given); given, "
        "the reference runs in a group of its own unless --colocate_actor_ref or "
        "--colocate_all; none: inside the actor group's ranks", None, trainers=RAY_TRAINERS)
    ref_num_gpus_per_node: int | None = doc(
        "Ray: the reference group's ranks (devices) per node (1 if only ref_num_nodes is "
        "given); its size must divide the actor group's: actor rank i asks its rank i mod size",
        None, trainers=RAY_TRAINERS)
    critic_num_nodes: int | None = doc(
        "Ray: PPO's critic's nodes (1 if only critic_num_gpus_per_node is given); given, the "
        "critic trains in a group of its own unless --colocate_critic_reward or "
        "--colocate_all; none: inside the actor group's ranks", None, trainers=RAY_TRAINERS)
    critic_num_gpus_per_node: int | None = doc(
        "Ray: the critic group's ranks (devices) per node (1 if only critic_num_nodes is "
        "given); its size must divide the actor group's: actor rank i trains on its rank "
        "i mod size",
        None, trainers=RAY_TRAINERS)
    reward_num_nodes: int | None = doc(
        "Ray: the reward model's nodes (--reward_pretrain; 1 if only reward_num_gpus_per_node "
        "is given); given, it runs in a group of its own unless --colocate_critic_reward or "
        "--colocate_all; none: inside the actor group's ranks", None, trainers=RAY_TRAINERS)
    reward_num_gpus_per_node: int | None = doc(
        "Ray: the reward group's ranks (devices) per node (as ref_num_gpus_per_node)", None,
        trainers=RAY_TRAINERS)
    colocate_all: bool = doc(
        "Ray: the vLLM engines share the actor group's devices (a fractional share each), "
        "one engine of one device per rank's bundle", False, trainers=RAY_TRAINERS)
    colocate_actor_ref: bool = doc(
        "Ray: reference and actor share devices (the reference runs in the actor group's "
        "ranks)", False, trainers=RAY_TRAINERS)
    colocate_critic_reward: bool = doc(
        "Ray: critic and reward model share devices (both run in the actor group's ranks)",
        False, trainers=RAY_TRAINERS)

    def __post_init__(self) -> None:
        check_positive(self, "actor_num_nodes", "actor_num_gpus_per_node")
        if self.ray_device not in DEVICE_RESOURCES:
            fail("ray_device", self.ray_device, f"use one of {', '.join(DEVICE_RESOURCES)}")
        if self.ray_timeout <= 0:
            fail("ray_timeout", self.ray_timeout, "use a positive number of seconds, e.g. 300")
        actor = (self.actor_num_nodes, self.actor_num_gpus_per_node)
        for group in ("ref", "critic", "reward"):
            names = (f"{group}_num_nodes", f"{group}_num_gpus_per_node")
            if self.apart(group):
                check_positive(self, *(name for name in names if getattr(self, name) is not None))
                given = names[1] if getattr(self, names[1]) is not None else names[0]
                if self.world_size % self.group_size(group):
                    fail(given, getattr(self, given),
                         f"a {COLOCATE[group][0]} group of its own answers actor rank i from "
                         f"its rank i mod its size, which must divide the actor group's "
                         f"{self.world_size} ranks (it has {self.group_size(group)}); give a "
                         f"divisor, or pass {COLOCATE[group][1]}")
                continue
            for name, same in zip(names, actor):
                value = getattr(self, name)
                if value is not None and value != same:
                    fail(name, value, f"the {COLOCATE[group][0]} runs inside the actor group's "
                         f"ranks ({COLOCATE[group][2]}): give the actor's {same} or drop it")

    def apart(self, group: str) -> bool:
        """``group`` (ref, critic, reward) in a Ray group of its own (OpenRLHF's placement when
        its size is given and it is not colocated), not inside the actor group's ranks."""
        given = any(getattr(self, f"{group}_{name}") is not None
                    for name in ("num_nodes", "num_gpus_per_node"))
        colocated = self.colocate_actor_ref if group == "ref" else self.colocate_critic_reward
        # (colocate_critic_reward: OpenRLHF shares one group's devices; here both are the
        # actor group's ranks')
        return given and not (colocated or self.colocate_all)

    def group_size(self, group: str) -> int:
        """A group of its own's ranks: nodes x devices per node, each 1 when not given."""
        return ((getattr(self, f"{group}_num_nodes") or 1)
                * (getattr(self, f"{group}_num_gpus_per_node") or 1))

    @property
    def world_size(self) -> int:
        """The actor group's ranks."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node
