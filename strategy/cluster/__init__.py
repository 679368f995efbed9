"""Online RL across machines on Ray, placed as OpenRLHF places it: the actor group's ranks, the
reference and reward model groups and the vLLM engines are Ray actors in placement groups
(``--actor_num_nodes``, ``--actor_num_gpus_per_node``, ``--ref_num_nodes``,
``--reward_num_nodes``, ``--vllm_num_engines``, ``--vllm_tensor_parallel_size``,
``--colocate_all``), driven by one process (``driver.run_on_ray``); the engines' layer is
``strategy.rollout.vllm_ray`` (the actor) and ``strategy.rollout.ray_rollout`` (the ranks' side).

- ``config``: ``ClusterConfig``, the placement flags.
- ``placement``: the bundles asked for, checked against the cluster before anything is
  reserved, reserved with a deadline, ordered by node.
- ``settings``: the job's settings checked before anything starts, and its model groups.
- ``driver``: the job: settings checked, Ray joined or started, actors placed and run,
  ``placement.json``, everything torn down however it ends.
- ``model_group``: a frozen model's group of its own (the reference, the reward model): its
  Ray ranks (an actor rank asks them through ``strategy.rollout.remote_models``).

May import: ``strategy.errors``, ``strategy.config``, ``strategy.rollout``, ``strategy.trainers``
(the commands its ranks run), and Ray (the optional extra), only once a Ray job runs.
"""

from strategy.config.cluster import ClusterConfig

__all__ = ["ClusterConfig", "run_on_ray"]


def run_on_ray(command: str, argv: list[str]):
    """``driver.run_on_ray``: ``command``'s job on Ray; rank 0's result."""
    from strategy.cluster.driver import run_on_ray as run  # imports Ray's pieces, trainers

    return run(command, argv)
