"""Where a Ray job's groups run: one bundle per device (``num_nodes x num_gpus_per_node`` for the
actor group, ``tensor_parallel_size`` devices for each vLLM engine), in placement groups reserved
before any actor starts, each wait bounded. A placement the cluster cannot hold is one line: what
was asked, what the cluster has, which flag to change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strategy.config.cluster import ClusterConfig
from strategy.errors import ConfigError
from strategy.rollout.config import RolloutConfig

INSTALL = "pip install '.[ray]'"


def require_ray() -> Any:
    """The ``ray`` module, or one line naming the extra."""
    try:
        import ray  # the optional extra: a Ray job only
    except ImportError:
        raise ConfigError(f"ray=True is invalid: Ray is not installed; {INSTALL} (or launch "
                          "with torchrun: strategy <trainer> --nproc N)") from None
    return ray


def device_bundle(cluster: ClusterConfig, devices: int = 1) -> dict[str, float]:
    """The resources of a bundle of ``devices`` devices (and a CPU each)."""
    if cluster.ray_device == "CPU":
        return {"CPU": float(devices)}
    return {"GPU": float(devices), "CPU": float(devices)}


def actor_share(cluster: ClusterConfig, bundle: dict[str, float], share: float) -> dict:
    """Ray actor options taking ``share`` of ``bundle``."""
    options = {"num_cpus": bundle["CPU"] * share}
    if "GPU" in bundle:
        options["num_gpus"] = bundle["GPU"] * share
    return options


@dataclass(frozen=True)
class Plan:
    """The bundles a job asks for: the actor group's (shared with the engines under
    ``colocate_all``), the engines' own, and each model group's of its own (``ref``,
    ``reward``)."""

    actor: list[dict[str, float]]
    engines: list[dict[str, float]]
    colocated: bool
    groups: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def bundles(self) -> list[dict[str, float]]:
        return self.actor + self.engines + [b for group in self.groups.values() for b in group]

    def asked(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for bundle in self.bundles():
            for key, value in bundle.items():
                total[key] = total.get(key, 0.0) + value
        return total


def plan(cluster: ClusterConfig, rollout: RolloutConfig, groups: tuple[str, ...] = ()) -> Plan:
    """The job's bundles (``groups``: its model groups of their own), or one line for a
    placement this layout cannot take."""
    actor = [device_bundle(cluster)] * cluster.world_size
    apart = {group: [device_bundle(cluster)] * cluster.group_size(group) for group in groups}
    n, tp = rollout.vllm_num_engines, rollout.vllm_tensor_parallel_size
    if cluster.colocate_all and n:
        if tp != 1 or n > cluster.world_size:
            raise ConfigError(f"colocate_all=True is invalid with vllm_num_engines={n} and "
                              f"vllm_tensor_parallel_size={tp}: a colocated engine shares one "
                              f"rank's device; use at most {cluster.world_size} engines of "
                              "tensor parallel 1, or drop --colocate_all")
        return Plan(actor, [], True, apart)
    return Plan(actor, [device_bundle(cluster, tp)] * n, False, apart)


def _shown(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def check_fits(job: Plan, ray: Any) -> None:
    """One line, before anything is reserved, when the cluster's nodes cannot hold the plan."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    have: dict[str, float] = {}
    for resources in nodes:
        for key in ("GPU", "CPU"):
            have[key] = have.get(key, 0.0) + resources.get(key, 0.0)
    asked = job.asked()
    short = [key for key, value in asked.items() if value > have.get(key, 0.0)]
    too_big = [bundle for bundle in job.bundles()
               if not any(all(res.get(k, 0.0) >= v for k, v in bundle.items()) for res in nodes)]
    if short or too_big:
        what = (f"{len(job.actor)} actor bundles of {_shown(job.actor[0])}"
                + (f" and {len(job.engines)} vLLM engine bundles of {_shown(job.engines[0])}"
                   if job.engines else "")
                + "".join(f" and {len(bundles)} {group} bundles of {_shown(bundles[0])}"
                          for group, bundles in job.groups.items()))
        raise ConfigError(
            f"the Ray placement does not fit: it asks {what} ({_shown(asked)} in all), the "
            f"cluster's {len(nodes)} node(s) have {_shown(have)}"
            + (f", none holding a bundle of {_shown(too_big[0])}" if too_big else "")
            + "; lower --actor_num_nodes/--actor_num_gpus_per_node or --vllm_num_engines/"
            "--vllm_tensor_parallel_size" + "".join(
                f" or --{group}_num_nodes/--{group}_num_gpus_per_node" for group in job.groups)
            + ", pass --colocate_all, or add nodes")


def reserve(ray: Any, bundles: list[dict[str, float]], strategy: str, timeout: float,
            what: str) -> Any:
    """A placement group of ``bundles``, ready within ``timeout`` s, or one line (it is removed
    first)."""
    from ray.util.placement_group import (  # the optional extra: a Ray job only
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        state = placement_group_table(group).get("state", "PENDING")
        remove_placement_group(group)
        raise ConfigError(f"the Ray placement of the {what} ({len(bundles)} bundles of "
                          f"{_shown(bundles[0])}) was not ready within --ray_timeout="
                          f"{timeout:g} s (state {state}): free or add resources, or lower the "
                          "group's size") from None
    return group


def ordered_bundles(ray: Any, group: Any) -> list[tuple[int, str, str]]:
    """The group's bundles as ``(bundle index, node id, node address)``, ordered by node (the
    node of bundle 0 first), then bundle: consecutive ranks share a node."""
    from ray.util.placement_group import placement_group_table  # the optional extra: a Ray job only

    nodes = placement_group_table(group)["bundles_to_node_id"]
    address = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    first = {}
    for index in sorted(nodes):
        first.setdefault(nodes[index], index)
    order = sorted(nodes, key=lambda index: (first[nodes[index]], index))
    return [(index, nodes[index], address.get(nodes[index], "")) for index in order]
