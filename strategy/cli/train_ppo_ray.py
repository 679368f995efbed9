"""OpenRLHF's entry point for online RL on Ray, taking its flags (and ours): its advantage
estimator picks the trainer as OpenRLHF's does (gae, its default: PPO with a critic; the outcome
estimators, group_norm, reinforce, rloo...: GRPO); the placement flags place the actor group and
the vLLM engines (``strategy.cluster``). It joins the cluster at RAY_ADDRESS (or
--ray_address), else starts a Ray of its own for the job.

python -m strategy.cli.train_ppo_ray --actor.model_name_or_path MODEL --actor.num_nodes 1 \
    --actor.num_gpus_per_node 2 --vllm.num_engines 1 --algo.advantage.estimator group_norm ...
ray job submit --address=http://HEAD:8265 --runtime-env-json='{"working_dir": "."}' -- \
    python -m strategy.cli.train_ppo_ray ...
"""

from __future__ import annotations

import sys

from strategy.cli.main import run_ray_job

ESTIMATOR_FLAGS = ("--algo.advantage.estimator", "--advantage_estimator")
ENGINES_FLAGS = ("--vllm.num_engines", "--vllm_num_engines")


def flag_value(argv: list[str], names: tuple[str, ...], default: str) -> str:
    """The last value ``argv`` gives any of ``names`` (``--name V`` or ``--name=V``)."""
    found = default
    for index, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            found = value if eq else (argv[index + 1] if index + 1 < len(argv) else found)
    return found


def estimator(argv: list[str]) -> str:
    """The advantage estimator ``argv`` asks for (OpenRLHF's default: gae)."""
    return flag_value(argv, ESTIMATOR_FLAGS, "gae")


def rollout_argv(argv: list[str]) -> list[str]:
    """OpenRLHF's meaning of ``--vllm.num_engines N``: N > 0 generates on vLLM (ours:
    ``--rollout_engine vllm``, unless the command line names an engine), none in the ranks."""
    named = any(arg.partition("=")[0] == "--rollout_engine" for arg in argv)
    engines = flag_value(argv, ENGINES_FLAGS, "0")
    if named or not engines.isdigit() or int(engines) == 0:
        return argv
    return [*argv, "--rollout_engine", "vllm"]


def main(argv: list[str] | None = None) -> None:
    """Run the job; exit 0, or one line and exit 2 (a setting, Ray missing, a placement too
    large: before any model loads) or 1 (a rank or engine failed or died)."""
    argv = rollout_argv(list(sys.argv[1:] if argv is None else argv))
    run_ray_job("ppo" if estimator(argv) == "gae" else "grpo", ["--ray", *argv])


if __name__ == "__main__":
    main()
